"""NNEF export to tract_moe_ffn, checked in the real tract runtime.

Ground truth: the tiny models' own torch forward (logits, block outputs), the same
interventions made by moelens in a trace, and tract (the ``tract`` package) running the
archives. Needs the ``export`` extra (torch-to-nnef and tract), which CI installs.
"""

from __future__ import annotations

import copy
import gc
import getpass
import logging
import math
import os
import platform
import re
import socket
import stat
import subprocess
import sys
import tarfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import is_fake

pytest.importorskip("torch_to_nnef", reason="the export extra is not installed (pip install 'moelens[export]')")
pytest.importorskip("tract", reason="the export extra is not installed (pip install 'moelens[export]')")

import moelens  # noqa: E402
from moelens.export import Edits, ExportError, ExportRefused, run, to_nnef, verify  # noqa: E402
from moelens.export import archive  # noqa: E402
from moelens.export.edits import KINDS, as_edits  # noqa: E402
from moelens.testing import FAMILIES, TINY_OVERRIDES, tiny_inputs, tiny_model  # noqa: E402

ROOT = Path(__file__).parents[1]

#: torch-to-nnef ships extractors for these blocks; moelens exports them through its own, from the family table.
KNOWN_TO_T2N = ["mixtral", "qwen2_moe", "olmoe", "qwen3_moe", "gpt_oss", "granitemoe"]
#: Families torch-to-nnef has no MoE support for: whole tiny models export.
UNKNOWN_TO_T2N_MODELS = ["hunyuan_v1_moe", "flex_olmo", "mellum", "aria", "cohere2_moe", "deepseek_ocr2", "granitemoe_swa"]
#: ... and these export as blocks (their other layers, mamba / linear attention, do not trace in torch-to-nnef).
UNKNOWN_TO_T2N_BLOCKS = UNKNOWN_TO_T2N_MODELS + [
    "jamba", "minimax", "qwen3_next", "deepseek_v2", "qwen4_exp", "openai_privacy_filter",
]
#: ... and the other families the family table says export: every "yes" of the table is run in tract here.
MORE_BLOCKS = [
    "granitemoehybrid", "granitemoeshared", "qwen3_5_moe", "qwen3_omni_moe", "qwen3_vl_moe",
    "unlimited_ocr",
] + [family for family in ("lara_mini",) if family in FAMILIES]  # transformers 5.24
BLOCK_FAMILIES = KNOWN_TO_T2N + UNKNOWN_TO_T2N_BLOCKS + MORE_BLOCKS

#: tract's "approximate" level in float32, which every float32 export must meet.
ATOL, RTOL = 1e-4, 5e-4


def small(family: str, **overrides):
    """The family's tiny model with 2 decoder layers (per-layer lists cut to match)."""
    extra = {"num_hidden_layers": 2}
    for key, value in TINY_OVERRIDES[family].items():
        if isinstance(value, list) and len(value) == 4 and key != "moe_layers":
            extra[key] = value[:2]
    extra.update(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_model(family, **extra)


def tract_moe_calls(path: Path) -> list[str]:
    return re.findall(r"= tract_moe_ffn\((.*)\);", archive.graph_text(path))


def close(actual: np.ndarray, expected, atol: float = ATOL) -> None:
    expected = expected.detach().cpu().numpy() if isinstance(expected, torch.Tensor) else expected
    np.testing.assert_allclose(actual, expected, atol=atol, rtol=RTOL)


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("nnef")


# -- blocks ------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", BLOCK_FAMILIES)
def test_block_export_matches_torch_in_tract(family, out):
    hf = small(family)
    moe = moelens.wrap(hf).moes[0]
    hidden = torch.randn(2, 6, hf.config.hidden_size, generator=torch.Generator().manual_seed(1))
    report = to_nnef(moe, out / f"{family}-block.nnef.tgz", example_inputs=hidden)
    calls = tract_moe_calls(report.path)
    assert len(calls) == 1
    assert f"gate = '{report.blocks[0].gate}'" in calls[0]
    with torch.no_grad():
        expected = moe._module(hidden)
    expected = expected[0] if isinstance(expected, tuple) else expected
    close(run(report.path, hidden), expected)
    assert report.verification.meets("approximate")


def test_blocks_sharing_a_layer_index_keep_their_own_weights():
    """Two MoE blocks with the same layer number (two stacks under one root) each export their own router."""
    from moelens.export.exporter import prepare
    from moelens.export.target import Block, Target
    from moelens.families import registry

    first, second = tiny_model("mixtral", num_hidden_layers=1), tiny_model("mixtral", num_hidden_layers=1, seed=1)
    root = torch.nn.Module()
    root.first, root.second = first, second
    family = registry.get("mixtral")
    names = ["first.model.layers.0.mlp", "second.model.layers.0.mlp"]
    prepared = prepare(Target("model", root, [Block(name, family, 0) for name in names]))
    for name, source in zip(names, (first, second)):
        exported = prepared.root.model.get_submodule(name).moe.spec.wg
        assert torch.equal(exported, source.model.layers[0].mlp.gate.weight.float()), name


def test_layer_of_module_paths():
    from moelens.components.base import layer_of

    paths = {"model.layers.3.mlp": 3, "model.model.layers.12.mlp.experts": 12, "layers.0": 0, "3.mlp": 3,
             "": None, "a.b": None, "layers.10a.mlp": None}
    assert {path: layer_of(path) for path in paths} == paths


def test_block_details_follow_the_family_table(out):
    # qwen2_moe: softmax over all E without renormalisation, a sigmoid-gated shared expert in plain NNEF.
    qwen = to_nnef(moelens.wrap(small("qwen2_moe")).moes[0], out / "qwen2-shared.nnef.tgz")
    graph = archive.graph_text(qwen.path)
    assert "gate = 'softmax_all'" in graph and "sigmoid(" in graph and "add(" in graph
    # with norm_topk_prob the same family renormalises: softmax over the top-k.
    normalised = to_nnef(moelens.wrap(small("qwen2_moe", norm_topk_prob=True)).moes[0], out / "qwen2-norm.nnef.tgz")
    assert "gate = 'softmax_topk'" in tract_moe_calls(normalised.path)[0]
    # gpt_oss: router and expert biases (9 inputs) and the clamped SwiGLU.
    gpt_report = to_nnef(moelens.wrap(small("gpt_oss")).moes[0], out / "gpt-oss.nnef.tgz")
    gpt = tract_moe_calls(gpt_report.path)[0]
    assert "act_alpha = 1.702" in gpt and "act_limit = 7.0" in gpt
    assert gpt_report.blocks[0].activation == "clamped swiglu (alpha 1.702, limit 7)"  # the report says so too
    assert len([a for a in gpt.split(",") if "=" not in a]) == 9


# -- whole models ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", KNOWN_TO_T2N + UNKNOWN_TO_T2N_MODELS)
def test_model_export_matches_torch_in_tract(family, out):
    hf = small(family)
    wrapped = moelens.wrap(hf)
    ids = tiny_inputs(hf, batch=1, seq=7)["input_ids"]
    report = to_nnef(wrapped, out / f"{family}.nnef.tgz", example_inputs=ids)
    assert len(tract_moe_calls(report.path)) == len(wrapped.moes)
    with torch.no_grad():
        output = hf(input_ids=ids, attention_mask=torch.ones_like(ids))
    expected = output.logits if hasattr(output, "logits") else output.last_hidden_state  # deepseek_ocr2: a text model
    close(run(report.path, ids), expected)
    assert report.verification.meets("approximate")


def test_a_base_models_archive_names_its_output_last_hidden_state(out):
    """A model without its head (MixtralModel) exports its hidden states: the archive named them logits."""
    lm = small("mixtral")
    base, ids = lm.model, tiny_inputs(lm, batch=1, seq=5)["input_ids"]
    report = to_nnef(moelens.wrap(base), out / "base.nnef.tgz", example_inputs=ids)
    assert report.output_name == "last_hidden_state"
    assert re.search(r"graph network\(\s*input_ids\s*\)\s*->\s*\(\s*last_hidden_state\s*\)", archive.graph_text(report.path))
    with torch.no_grad():
        close(run(report.path, ids), base(input_ids=ids).last_hidden_state)
    assert to_nnef(moelens.wrap(lm), out / "lm.nnef.tgz", example_inputs=ids).output_name == "logits"


def test_a_whole_model_tract_cannot_run_says_which_part_and_what_to_do(out):
    """mistral4's MLA attention traces in torch-to-nnef but fails tract's declutter: the error blamed tract alone
    and pointed nowhere; its MoE blocks export."""
    hf = small("mistral4", n_group=1, topk_group=1)
    wrapped = moelens.wrap(hf)
    with pytest.raises(ExportError, match=r"torch-to-nnef wrote this archive, but tract cannot load or run it \(.*self_attn.*\)\. "
                                          r"The MoE blocks were accepted; .* export its MoE blocks \(model.moes\[i\]\) instead"):
        to_nnef(wrapped, out / "mistral4-whole-model.nnef.tgz")
    assert to_nnef(wrapped.moes[0], out / "mistral4-block.nnef.tgz").verification.meets("approximate")

def test_a_whole_model_whose_eager_attention_fails_says_so_not_the_inputs(out):
    """unlimited_ocr's eager attention does not repeat its key/value heads (plain transformers: the model runs the ids
    in its own sdpa attention, and fails them once switched to eager); the export, which traces eager attention,
    said to pass other example inputs. Its blocks export."""
    hf = tiny_model("unlimited_ocr").eval()
    ids = torch.randint(3, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    eager = copy.deepcopy(hf)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        hf(input_ids=ids)
        with pytest.raises(RuntimeError, match="must match the size"):
            eager(input_ids=ids)
    wrapped = moelens.wrap(hf)
    with pytest.raises(ExportError, match=r"^this model's eager attention, which the export runs .* where its own sdpa "
                                          r"attention runs on these inputs.*Export its MoE blocks instead"):
        to_nnef(wrapped, out / "unlimited_ocr.nnef.tgz", example_inputs=ids)
    assert to_nnef(wrapped.moes[0], out / "unlimited_ocr-block.nnef.tgz").verification.meets("approximate")


def test_export_leaves_torch_to_nnef_as_it_was(out, monkeypatch):
    """The logsumexp fix (negative axis, granitemoe_swa's attention sinks) is in force only during an export, and so
    are the quieted loggers: torch_to_nnef's INFO lines and transformers' loss_type notice, which the tracer's walk
    over the model's attributes triggered (it showed in notebook 04)."""
    import torch_to_nnef
    from torch_to_nnef.op.aten import aten_ops_registry

    before = dict(aten_ops_registry._registry)
    loggers = [logging.getLogger(name) for name in ("torch_to_nnef", "transformers.modeling_utils")]
    levels = [logger.level for logger in loggers]
    during = []
    exporting = torch_to_nnef.export_model_to_nnef

    def watched(*args, **kwargs):
        during.append([logger.getEffectiveLevel() for logger in loggers])
        return exporting(*args, **kwargs)

    monkeypatch.setattr(torch_to_nnef, "export_model_to_nnef", watched)
    for logger in loggers:
        logger.setLevel(logging.DEBUG)  # the user's choice: the export quiets the libraries only while it runs
    try:
        to_nnef(moelens.wrap(small("granitemoe_swa")), out / "swa.nnef.tgz")
        assert [logger.level for logger in loggers] == [logging.DEBUG] * 2
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
    assert during == [[logging.ERROR] * 2]
    assert "logsumexp(" in archive.graph_text(out / "swa.nnef.tgz")
    assert "axis = -1" not in archive.graph_text(out / "swa.nnef.tgz")
    assert aten_ops_registry._registry == before


def test_export_leaves_no_handler_on_the_root_logger(out, monkeypatch):
    """torch-to-nnef's tracer logs with a bare logging.debug(...), which ran logging.basicConfig() on a root logger
    without handlers (a script's, before it configures logging): a stderr handler stayed, and the user's own
    basicConfig(filename=...) afterwards did nothing."""
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])  # as in a script (pytest's own capture handlers set aside)
    to_nnef(moelens.wrap(small("mixtral")), out / "root-logger.nnef.tgz")
    assert root.handlers == []
    logging.basicConfig(filename=out / "user.log", level=logging.INFO)
    try:
        logging.getLogger("user.script").info("configured")
        assert "configured" in (out / "user.log").read_text()
    finally:
        for handler in root.handlers:
            handler.close()


def test_exports_keep_no_copy_of_the_weights(out):
    """An export kept up to two copies of the exported weights alive for good: torch-to-nnef's cache of traced
    graphs held its tracers (each with a traced copy of a module), and torch.jit.trace made the tract_moe_ffn
    weights, which no module held, constants of the traced graph, which TorchScript never frees."""
    model = moelens.load()

    def live_bytes() -> int:
        gc.collect()
        storages = {o.untyped_storage().data_ptr(): o.untyped_storage().nbytes() for o in gc.get_objects()
                    if isinstance(o, torch.Tensor) and not o.is_meta and not is_fake(o)}  # fake: another test's (dynamo)
        return sum(storages.values())

    experts = sum(p.numel() * p.element_size() for p in model.moes[1].experts._module.parameters())
    to_nnef(model.moes[1], out / "kept.nnef.tgz", verify=False)  # the first export loads what it needs
    before = live_bytes()
    for _ in range(2):
        to_nnef(model.moes[1], out / "kept.nnef.tgz", verify=False)
        to_nnef(model, out / "kept-model.nnef.tgz", verify=False)
    assert live_bytes() - before < experts / 4


def test_moelens_tiny_exports(out):
    model = moelens.load()
    ids = torch.randint(3, model._module.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    report = to_nnef(model, out / "moelens-tiny.nnef.tgz", example_inputs=ids)
    assert len(tract_moe_calls(report.path)) == len(model.moes) == 4
    with torch.no_grad():
        expected = model._module(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    close(run(report.path, ids), expected)


def test_compressor_output_exports(out):
    """A dense model converted by moelens.compress.tomoe (tract's sigmoid gate: each selected expert weighs 1)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from moelens.compress import exportable, tomoe

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    calibration = torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted = exportable(tomoe(LlamaForCausalLM(config).eval(), num_experts=4, top_k=2,
                                     calibration=calibration, max_error=None, progress=False))
    wrapped = moelens.wrap(converted)
    assert len(wrapped.moes) == 2
    ids = calibration[:1, :8]
    report = to_nnef(wrapped, out / "tomoe.nnef.tgz", example_inputs=ids)
    assert [block.gate for block in report.blocks] == ["sigmoid", "sigmoid"]
    with torch.no_grad():
        close(run(report.path, ids), converted(input_ids=ids, attention_mask=torch.ones_like(ids)).logits)


class ReturnsADict(torch.nn.Module):
    def forward(self, input_ids):
        return {"scores": self.embed(input_ids)}


def test_the_exported_output_of_each_kind_of_model_output(tmp_path):
    from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput

    from moelens.export.exporter import named_output

    logits, hidden = torch.randn(2, 3, 5), torch.randn(2, 3, 4)
    for output, expected in ((logits, logits), ((logits, hidden), logits), (CausalLMOutput(logits=logits), logits),
                             (BaseModelOutput(last_hidden_state=hidden), hidden)):
        assert named_output(output)[1] is expected
    with pytest.raises(ExportError, match=r"the model returned dict, which holds no logits to export"):
        named_output({"scores": logits})
    from custom_models import custom_family, custom_model

    model = custom_model()
    model.__class__ = ReturnsADict
    moelens.families.register(custom_family())
    try:  # refused as such, not as a forward that failed
        with pytest.raises(ExportError, match=r"^the model returned dict, which holds no logits"):
            to_nnef(moelens.wrap(model), Path(tmp_path) / "dict.nnef.tgz")
    finally:
        moelens.families.unregister("custom")


class TakesAMask(torch.nn.Module):
    def forward(self, input_ids, attention_mask=None):
        hidden = self.embed(input_ids) * attention_mask[..., None]
        for layer in self.layers:
            hidden = hidden + layer["ffn"](hidden)
        return hidden


class FailsOnEightTokens(torch.nn.Module):
    def forward(self, input_ids):
        return self.layers[input_ids.shape[1]]  # 2 layers


def test_a_plain_torch_model_of_a_registered_family_exports(out):
    """A plain torch model (its forward takes input_ids only and returns a tensor): the archive kept only
    the first batch row (the tensor's [0]) and verified it against torch's, also cut; a forward without
    attention_mask failed; without a config the default token ids went past its 64-row embedding."""
    from custom_models import custom_family, custom_model

    moelens.families.register(custom_family())
    try:
        model = custom_model()
        ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))
        report = to_nnef(moelens.wrap(model), out / "custom.nnef.tgz", example_inputs=ids)
        assert report.verification.tolerance is not None and len(tract_moe_calls(report.path)) == 2
        with torch.no_grad():
            close(run(report.path, ids), model(ids))  # [2, 6, D]: every row
        masked = custom_model()
        masked.__class__ = TakesAMask  # a plain model's mask is its own (it got transformers' 4-D masks)
        for plain in (model, masked):
            dynamic = to_nnef(moelens.wrap(plain), out / "custom-dynamic.nnef.tgz", dynamic_tokens=True)
            for length in (3, 9):
                with torch.no_grad():
                    close(run(dynamic.path, ids[:1, :length]), model(ids[:1, :length]))
        del model.config  # no config: the default inputs are token ids the embedding holds
        report = to_nnef(moelens.wrap(model), out / "custom-bare.nnef.tgz")
        assert report.verification.tolerance is not None
        failing = custom_model()
        failing.__class__ = FailsOnEightTokens
        with pytest.raises(ExportError, match=r"model's forward failed in torch on the example inputs of shape "
                                              r"\(1, 8\) \(IndexError: index 8 is out of range\), before any tracing"):
            to_nnef(moelens.wrap(failing), out / "custom-failing.nnef.tgz")
    finally:
        moelens.families.unregister("custom")


# -- edits ---------------------------------------------------------------------------------


def test_edited_model_matches_the_intervened_torch_run(out):
    hf = small("mixtral")
    wrapped = moelens.wrap(hf)
    ids = tiny_inputs(hf, batch=1, seq=9)["input_ids"]
    edits = Edits(route_around={0: [1, 4]}, steer={1: {2: 3.0, 5: -1.0}}, ablate={1: [6]}, swap={0: {3: 7}})
    report = to_nnef(wrapped, out / "mixtral-edited.nnef.tgz", example_inputs=ids, edits=edits)
    with wrapped.trace(input_ids=ids, attention_mask=torch.ones_like(ids)):
        first, second = wrapped.moes
        moelens.ablate(first, 1, "route_around")
        moelens.ablate(first, 4, "route_around")
        moelens.ablate(first, 3, "swap", to=7)
        moelens.steer(second, 2, 3.0)
        moelens.steer(second, 5, -1.0)
        moelens.ablate(second, 6)
        edited = wrapped.output.logits.save()
    with torch.no_grad():
        plain = hf(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert (edited - plain).abs().max() > 1e-3  # the edits change the model
    tract_logits = run(report.path, ids)
    close(tract_logits, edited)
    assert report.verification.meets("approximate")
    assert verify(report.path, wrapped, ids).meets("approximate")  # replays the archive's recorded edits


def test_swaps_of_a_layer_act_at_once(out):
    # {1: 2, 2: 1} exchanges experts 1 and 2 in the archive and in Edits.intervene alike:
    # ground truth is the plain model with the two experts' weights exchanged by hand.
    hf = small("olmoe")
    wrapped = moelens.wrap(hf)
    ids = tiny_inputs(hf, batch=1, seq=12)["input_ids"]
    edits = Edits(swap={1: {1: 2, 2: 1}})
    report = to_nnef(wrapped, out / "olmoe-exchanged.nnef.tgz", example_inputs=ids, edits=edits)
    with wrapped.trace(input_ids=ids, attention_mask=torch.ones_like(ids)):
        edits.intervene(wrapped)
        edited = wrapped.output.logits.save()
    exchanged = small("olmoe")
    with torch.no_grad():
        for weight in (exchanged.model.layers[1].mlp.experts.gate_up_proj, exchanged.model.layers[1].mlp.experts.down_proj):
            weight[[1, 2]] = weight[[2, 1]].clone()
        expected = exchanged(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        assert (expected - hf(input_ids=ids, attention_mask=torch.ones_like(ids)).logits).abs().max() > 1e-3
    close(edited.detach().numpy(), expected, atol=1e-5)
    close(run(report.path, ids), expected)
    assert report.verification.meets("approximate")


def test_steered_block_with_router_bias_matches_moelens(out):
    # gpt_oss has its own router bias: steering adds to it; zero ablation also zeroes the experts' down bias.
    hf = small("gpt_oss")
    wrapped = moelens.wrap(hf)
    ids = tiny_inputs(hf, batch=1, seq=8)["input_ids"]
    moe = wrapped.moes[1]
    with wrapped.trace(input_ids=ids, attention_mask=torch.ones_like(ids)):
        hidden = moe.input.save()
        moelens.steer(moe, 4, 2.5)
        moelens.ablate(moe, 0)
        expected = moe.mlp_output.save()
    edits = Edits(steer={1: {4: 2.5}}, ablate={1: [0]})
    report = to_nnef(moe, out / "gpt-oss-steered.nnef.tgz", example_inputs=hidden, edits=edits)
    close(run(report.path, hidden), expected)
    with torch.no_grad():
        assert (moe._module(hidden)[0] - expected).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v2"])
def test_block_with_every_baked_edit_matches_the_intervened_block(family, out):
    """The block archive's own check compares tract with tract's maths run in torch; here the archive is compared
    with moelens' interventions on the block in a trace (routing edits, a shared expert, group routing)."""
    hf = small(family)
    wrapped = moelens.wrap(hf)
    ids = tiny_inputs(hf, batch=1, seq=10)["input_ids"]
    moe = wrapped.moes[0]
    edits = Edits(steer={moe.layer: {5: 1.5}}, route_around={moe.layer: [1]}, ablate={moe.layer: [2]},
                  swap={moe.layer: {3: 6}})
    with wrapped.trace(input_ids=ids, attention_mask=torch.ones_like(ids)):
        hidden = moe.input.save()
        plain = moe.mlp_output.save()
    with wrapped.trace(input_ids=ids, attention_mask=torch.ones_like(ids)):
        edits.apply(moe)
        expected = moe.mlp_output.save()
    assert (expected - plain).abs().max() > 1e-4  # the edits change the block
    report = to_nnef(moe, out / f"{family}-edited-block.nnef.tgz", example_inputs=hidden, edits=edits)
    close(run(report.path, hidden), expected)


def test_weights_edited_in_place_are_exported(out):
    hf = small("olmoe")
    with torch.no_grad():
        hf.model.layers[1].mlp.experts.down_proj[2].mul_(-3.0)
    wrapped = moelens.wrap(hf)
    ids = tiny_inputs(hf, batch=1, seq=6)["input_ids"]
    report = to_nnef(wrapped, out / "olmoe-in-place.nnef.tgz", example_inputs=ids)
    with torch.no_grad():
        close(run(report.path, ids), hf(input_ids=ids, attention_mask=torch.ones_like(ids)).logits)


def test_edits_tract_cannot_express_are_refused(out):
    wrapped = moelens.wrap(small("mixtral"))
    refused = {
        r"force.*Edits\(steer=\{0: \{1: 30.0, 5: 30.0\}\}\)": Edits(force={0: [5, 1]}),  # the forced experts named
        "names every one of the layer's 8 experts": Edits(route_around={0: list(range(8))}),
    }
    for message, edits in refused.items():
        path = out / "refused.nnef.tgz"
        with pytest.raises(ExportRefused, match=message):
            to_nnef(wrapped, path, edits=edits, verify=False)
        assert not path.exists()
    with pytest.raises(ExportError, match="out of range"):
        to_nnef(wrapped, out / "bad.nnef.tgz", edits=Edits(steer={0: {8: 1.0}}))
    with pytest.raises(ExportError, match=r"Edits.ablate\[5\] names a layer with no MoE block here; the MoE layers are \[0, 1\]"):
        to_nnef(wrapped, out / "bad.nnef.tgz", edits=Edits(ablate={5: [0]}))
    with pytest.raises(ExportError, match="not finite"):
        Edits(steer={0: {1: float("inf")}})
    for flag in ("verify", "dynamic_tokens"):  # "False" is truthy: it was taken as True
        with pytest.raises(ExportError, match=rf"^{flag} must be True or False, got 'False' \(str\)"):
            to_nnef(wrapped, out / "bad.nnef.tgz", **{flag: "False"})
    assert not (out / "bad.nnef.tgz").exists()


def test_edits_refuse_what_the_trace_interventions_refuse(out):
    """A steer bias past float32 (1e39) was baked as an inf router bias (the archive computed NaN; moelens.steer
    refuses it), a swap of an expert to itself was baked as "swap 3->3" (ablate(..., "swap", to=3) refuses it), and
    a NaN bias was told to use route_around."""
    wrapped = moelens.wrap(small("mixtral"))
    ids = torch.randint(0, wrapped._module.config.vocab_size, (1, 6))
    path = out / "refused.nnef.tgz"
    with pytest.raises(ExportError, match=r"^Edits\.steer\[0\]: the bias 1e\+39 of expert 3 takes its router bias "
                                          r"beyond what the archive's float32 router bias holds \(3\.403e\+38"):
        to_nnef(wrapped, path, edits=Edits(steer={0: {3: 1e39}}), verify=False)
    with torch.no_grad(), pytest.raises(moelens.WriteError, match=r"bias 1e\+39 takes expert 3's logits up"):
        with wrapped.trace(ids):  # the trace's own refusal of the same bias
            Edits(steer={0: {3: 1e39}}).intervene(wrapped)
    swapped = r"^Edits\.swap\[0\]: experts \[3\] are swapped to themselves, so nothing would change"
    with pytest.raises(ExportError, match=swapped):
        to_nnef(wrapped, path, edits=Edits(swap={0: {3: 3, 1: 2}}), verify=False)
    with pytest.raises(ExportError, match=swapped), torch.no_grad():
        with wrapped.trace(ids):
            Edits(swap={0: {3: 3}}).intervene(wrapped)
    assert not path.exists()
    with pytest.raises(ExportError, match=r"experts \[1, 2\] are not finite \(\[nan, -inf\]\); give finite biases"):
        Edits(steer={0: {1: float("nan"), 2: -math.inf}})


_EXPERT_ID = r"must be an int expert id \(a Python or numpy integer, or a one-element integer tensor\), got "
_LAYER_ID = r": layer must be an int decoder layer index \(moe\.layer: .*\), got "
_IDS_FORM = r"; ablate maps a layer to expert ids: \{layer: \[expert, \.\.\.\]\}\.$"


@pytest.mark.parametrize("fields, message", [
    # ids moelens.ablate / steer refuse were truncated: [3.7] -> expert 3, True -> expert 1, layer 1.5 -> layer 1
    ({"ablate": {1: [3.7]}}, r"^Edits\.ablate\[1\]: expert " + _EXPERT_ID + r"3\.7" + _IDS_FORM),
    ({"ablate": {1: True}}, r"^Edits\.ablate\[1\]: expert " + _EXPERT_ID + "True" + _IDS_FORM),
    ({"ablate": {1: 3.0}}, r"^Edits\.ablate\[1\]: expert " + _EXPERT_ID + r"3\.0" + _IDS_FORM),
    ({"ablate": {1: [np.float64("nan")]}}, r"^Edits\.ablate\[1\]: expert " + _EXPERT_ID + r"np\.float64\(nan\)" + _IDS_FORM),
    ({"ablate": {1: torch.tensor(3.0)}}, r"^Edits\.ablate\[1\]: expert " + _EXPERT_ID + r"tensor\(3\.\)" + _IDS_FORM),
    ({"ablate": {1: "3"}}, r"^Edits\.ablate\[1\]: expert " + _EXPERT_ID + "'3'" + _IDS_FORM),
    ({"ablate": {1.5: [3]}}, r"^Edits\.ablate" + _LAYER_ID + r"1\.5" + _IDS_FORM),
    ({"ablate": {True: [3]}}, r"^Edits\.ablate" + _LAYER_ID + "True" + _IDS_FORM),
    ({"ablate": {"1": [3]}}, r"^Edits\.ablate" + _LAYER_ID + "'1'" + _IDS_FORM),
    ({"route_around": {1: [2, 4.0]}}, r"^Edits\.route_around\[1\]: expert " + _EXPERT_ID + r"4\.0; route_around maps"),
    ({"force": {1: [False]}}, r"^Edits\.force\[1\]: expert " + _EXPERT_ID + "False; force maps"),
    ({"swap": {1: {2: 3.9}}}, r"^Edits\.swap\[1\]: the replacement of expert 2 " + _EXPERT_ID
     + r"3\.9; swap maps a layer to swaps: \{layer: \{expert: to\}\}\.$"),
    ({"swap": {1: {2.0: 3}}}, r"^Edits\.swap\[1\]: expert " + _EXPERT_ID + r"2\.0; swap maps"),
    ({"steer": {1: {2.5: 1.0}}}, r"^Edits\.steer\[1\]: expert " + _EXPERT_ID + r"2\.5; steer maps"),
    ({"steer": {1.0: {2: 1.0}}}, r"^Edits\.steer" + _LAYER_ID + r"1\.0; steer maps"),
    ({"steer": {1: {2: True}}}, r"^Edits\.steer\[1\]: the bias of expert 2 must be a number \(a Python or numpy "
     r"number, or a one-element tensor\), got True; steer maps a layer to expert biases: \{layer: \{expert: bias\}\}\.$"),
    ({"steer": {1: {2: "1.0"}}}, r"^Edits\.steer\[1\]: the bias of expert 2 must be a number .*, got '1\.0'; steer maps"),
    ({"steer": {1: {2: torch.tensor([1.0, 2.0])}}}, r"^Edits\.steer\[1\]: the bias of expert 2 must be a number .*, "
     r"got tensor\(\[1\., 2\.\]\); steer maps"),
])
def test_edits_refuse_ids_and_biases_the_interventions_refuse(fields, message):
    """A float, bool or str id was truncated (int(3.7) == 3, int(True) == 1) where moelens.ablate refuses it."""
    with pytest.raises(ExportError, match=message):
        Edits(**fields)
    with pytest.raises(ExportError, match=message):  # the same through to_nnef's edits={...}
        as_edits(fields)


@pytest.mark.parametrize("fields, message", [
    ({"ablate": [3]}, r"^Edits\.ablate must be a dict, got \[3\]" + _IDS_FORM),
    ({"ablate": None}, r"^Edits\.ablate must be a dict, got None" + _IDS_FORM),
    ({"ablate": {1: {3: 1.0}}}, r"^Edits\.ablate\[1\] must be expert ids \(one, or a list of them\), got \{3: 1\.0\}"
     + _IDS_FORM),
    ({"steer": {2: 1.0}}, r"^Edits\.steer\[2\] must be a dict, got 1\.0; steer maps a layer to expert biases: "
     r"\{layer: \{expert: bias\}\}\.$"),
    ({"steer": [(2, {5: 1.0})]}, r"^Edits\.steer must be a dict, got \[\(2, \{5: 1\.0\}\)\]; steer maps"),
    ({"swap": {1: [2, 3]}}, r"^Edits\.swap\[1\] must be a dict, got \[2, 3\]; swap maps a layer to swaps: "
     r"\{layer: \{expert: to\}\}\.$"),
    # a layer or expert given twice, once as a tensor (which dict keys do not merge): one would be dropped
    ({"ablate": {1: [3], torch.tensor(1): [4]}}, r"^Edits\.ablate names layer 1 twice \(as 1 and tensor\(1\)\); give each once\.$"),
    ({"steer": {1: {3: 1.0, torch.tensor(3): 2.0}}}, r"^Edits\.steer\[1\] names expert 3 twice \(as 3 and tensor\(3\)\)"),
    # an expert listed twice was kept twice (the archive recorded ablate:1:2,2) where steer / swap refuse it
    ({"ablate": {1: [2, 2]}}, r"^Edits\.ablate\[1\] names expert 2 twice \(as 2 and 2\); give each expert once\.$"),
    ({"ablate": {1: [2, 5, np.int64(2)]}}, r"^Edits\.ablate\[1\] names expert 2 twice \(as 2 and np\.int64\(2\)\)"),
    ({"route_around": {0: torch.tensor([4, 4])}}, r"^Edits\.route_around\[0\] names expert 4 twice"),
])
def test_edits_in_the_wrong_form_say_the_form_expected(fields, message):
    """A lone number for steer / swap, a list for a dict: a raw TypeError ("'float' object is not iterable")."""
    with pytest.raises(ExportError, match=message):
        Edits(**fields)


def test_edits_from_text_reads_its_own_text_and_refuses_other_things():
    """Edits.from_text(3) raised a bare AttributeError ('int' object has no attribute 'split')."""
    edits = Edits(route_around={0: [1, 4]}, steer={1: {2: 3.0}}, ablate={1: [6]}, swap={0: {3: 7}})
    assert Edits.from_text(edits.to_text()) == edits and Edits.from_text("") == Edits()
    with pytest.raises(ExportError, match=r"^Edits\.from_text takes the text Edits\.to_text gives \(a str\), got int 3\.$"):
        Edits.from_text(3)
    with pytest.raises(ExportError, match=r"cannot read edits from 'zap:1:1' \(at 'zap:1:1'\): each part is "
                                          r"kind:layer:items, kind one of steer, route_around, swap, ablate, force"):
        Edits.from_text("zap:1:1")  # said where, not what it reads


@pytest.mark.parametrize("text, twice", [
    ("ablate:1:2;ablate:1:3", "layer 1 in two ablate parts"),  # read as {1: (3,)}: expert 2 lost
    ("steer:1:2=1.0;steer:1:4=5.0", "layer 1 in two steer parts"),
    ("swap:0:2=3,2=5", "an expert twice in 'swap:0:2=3,2=5'"),  # read as {0: {2: 5}}
])
def test_edits_from_text_refuses_a_part_that_would_replace_another(text, twice):
    with pytest.raises(ExportError, match=rf"cannot read edits from '{text}': it names {twice}"):
        Edits.from_text(text)


def _same_edits(given: dict, plain: dict) -> None:
    edits = Edits(**given)
    assert edits == Edits(**plain)
    assert edits.to_text() == Edits(**plain).to_text()
    assert hash(edits) == hash(Edits(**plain))
    assert all(type(layer) is int for layer in getattr(edits, next(iter(plain))))


def test_edits_key_a_dict_and_fill_a_set_as_values():
    """A frozen dataclass is expected to hash; Edits' was the dataclass' own, which raised "unhashable type:
    'dict'". Equal edits are one key, whatever order they were given in; edits that differ are not."""
    results = {Edits(steer={2: {5: 2.0, 1: -1.0}}, ablate={1: [3]}): "a"}
    assert results[Edits(ablate={1: [3]}, steer={2: {1: -1.0, 5: 2.0}})] == "a"
    variants = [Edits(), Edits(ablate={1: [3]}), Edits(route_around={1: [3]}), Edits(ablate={1: [3, 4]}),
                Edits(ablate={2: [3]}), Edits(steer={1: {3: 1.0}}), Edits(swap={1: {3: 1}}), Edits(ablate={1: [4, 3]})]
    assert len(set(variants)) == len(variants)  # [4, 3] is kept in its order, as == compares it
    assert set(variants) == {*variants, *(Edits(**{kind: getattr(edits, kind) for kind in KINDS}) for edits in variants)}


@pytest.mark.parametrize("given, plain", [
    ({"ablate": {1: np.int64(3)}}, {"ablate": {1: [3]}}),
    ({"ablate": {1: torch.tensor(3)}}, {"ablate": {1: [3]}}),
    ({"ablate": {1: np.array(3)}}, {"ablate": {1: [3]}}),
    ({"route_around": {1: np.int32(3)}}, {"route_around": {1: [3]}}),
    ({"force": {1: torch.tensor(3)}}, {"force": {1: [3]}}),
])
def test_edits_take_a_lone_expert_id_in_every_form_an_int_is_taken(given, plain):
    """{1: 3} was taken as [3], but np.int64(3) or torch.tensor(3) raised a raw TypeError (not iterable)."""
    _same_edits(given, plain)


@pytest.mark.parametrize("given, plain", [  # forms taken before too: kept as moelens' interventions take them
    ({"ablate": {1: 3}}, {"ablate": {1: [3]}}),
    ({"ablate": {1: torch.tensor([3])}}, {"ablate": {1: [3]}}),
    ({"ablate": {1: torch.tensor([3, 4])}}, {"ablate": {1: [3, 4]}}),
    ({"ablate": {1: np.array([3, 4])}}, {"ablate": {1: [3, 4]}}),
    ({"ablate": {1: (np.int64(3), torch.tensor(4))}}, {"ablate": {1: [3, 4]}}),
    ({"route_around": {1: range(3, 5)}}, {"route_around": {1: [3, 4]}}),
    ({"ablate": {np.int64(1): [3]}}, {"ablate": {1: [3]}}),
    ({"ablate": {torch.tensor(1): [3]}}, {"ablate": {1: [3]}}),
    ({"steer": {torch.tensor(1): {np.int64(2): 1.5}}}, {"steer": {1: {2: 1.5}}}),
    ({"steer": {1: {2: np.float32(1.5)}}}, {"steer": {1: {2: 1.5}}}),  # biases: any real number, as steer takes
    ({"steer": {1: {2: torch.tensor(1.5)}}}, {"steer": {1: {2: 1.5}}}),
    ({"steer": {1: {2: np.int64(2)}}}, {"steer": {1: {2: 2.0}}}),
    ({"steer": {1: {2: 2}}}, {"steer": {1: {2: 2.0}}}),
    ({"swap": {np.int64(1): {torch.tensor(2): np.int64(3)}}}, {"swap": {1: {2: 3}}}),
    ({"swap": {1: {2: torch.tensor([3])}}}, {"swap": {1: {2: 3}}}),
])
def test_edits_still_take_ids_and_biases_in_the_forms_the_interventions_take(given, plain):
    _same_edits(given, plain)


def test_edits_made_in_a_trace_are_checked_as_the_export_checks_them():
    """Edits.intervene / apply (what verify runs) raised a raw IndexError or dropped edits silently."""
    wrapped = moelens.wrap(tiny_model("qwen2_moe"))  # layer 0 dense, MoE layers 1-3, 8 experts
    ids = tiny_inputs(wrapped._module, batch=1, seq=6)["input_ids"]
    refused = {
        r"Edits.force\[1\] cannot be baked": Edits(force={1: [3]}),
        r"Edits.ablate\[0\] names a layer with no MoE block here; the MoE layers are \[1, 2, 3\]": Edits(ablate={0: [3]}),
        r"Edits.steer\[0\], Edits.route_around\[7\] name layers with no MoE block": Edits(route_around={7: [3]},
                                                                                          steer={0: {1: 2.0}}),
        r"Edits.swap\[1\]: experts \[9\] out of range: layer 1's MoE block has 8 experts; give expert ids 0..7\.":
            Edits(swap={1: {9: 2}}),
        r"Edits.swap\[1\]: experts \[-1\] out of range": Edits(swap={1: {-1: 2}}),  # was expert 7
        # the replacement, not the swapped expert: it said "experts [9]"
        r"Edits.swap\[1\]: replacements \(the experts taking over the slots\) \[9\] out of range":
            Edits(swap={1: {2: 9}}),
        r"Edits.ablate\[1\] and Edits.swap\[1\] both name experts \[3\]": Edits(ablate={1: [3]}, swap={1: {3: 4}}),
    }
    for message, edits in refused.items():
        with pytest.raises(ExportError, match=message):
            with wrapped.trace(ids):
                edits.intervene(wrapped)
    with pytest.raises(ExportError, match=r"Edits.steer\[2\]: experts \[8\] out of range"):
        with wrapped.trace(ids):
            Edits(steer={2: {8: 1.0}}).apply(wrapped.moes[1])
    with pytest.raises(moelens.MoelensError, match=r"model must be a model wrapped by moelens, got Qwen2MoeForCausalLM"):
        Edits(ablate={1: [2]}).intervene(wrapped._module)  # was torch's "object has no attribute 'moes'"


def test_edits_made_in_a_trace_refuse_a_layer_of_several_blocks_as_the_export_does():
    """ernie4_5_vl_moe's layers hold a text and a vision block. The export refuses Edits keyed by such a layer as
    ambiguous; in a trace, Edits.intervene made them on every block of the layer (the range checked on one of them),
    so the vision block's experts were ablated too. Ground truth: model.moes, which lists both blocks at layer 1."""
    wrapped = moelens.wrap(tiny_model("ernie4_5_vl_moe"))
    assert [moe.layer for moe in wrapped.moes][:2] == [1, 1]
    with pytest.raises(ExportError, match=r"layer 1 holds several MoE blocks \(model.moes\[0\] is "
                                          r"model.layers.1.mlp.text_moe, model.moes\[1\] is "
                                          r"model.layers.1.mlp.vision_moe\), so Edits keyed by layer are ambiguous"):
        with wrapped.trace(**tiny_inputs(wrapped._module)):
            Edits(ablate={1: [0]}).intervene(wrapped)


def test_edits_on_a_plain_block_say_it_has_no_layer(out):
    """A transformers block exported on its own has no layer number for Edits to name; the message says so."""
    hf = small("mixtral")
    path = out / "plain-block-edits.nnef.tgz"
    with pytest.raises(ExportError, match=r"has no layer number.*moelens\.wrap\(model\)\.moes\[i\]"):
        to_nnef(hf.model.layers[1].mlp, path, edits=Edits(ablate={1: [0]}))
    assert not path.exists()


def test_interventions_the_export_would_drop_are_refused(out):
    hf = small("mixtral")
    wrapped = moelens.wrap(hf)
    with wrapped.edit(inplace=True):
        wrapped.moes[0].router_logits[..., 0] = 0.0
    with pytest.raises(ExportRefused, match="nnsight edit"):
        to_nnef(wrapped, out / "edited.nnef.tgz")
    wrapped.clear_edits()
    handle = hf.model.layers[1].mlp.experts.register_forward_hook(lambda module, args, output: output * 2)
    with pytest.raises(ExportRefused, match=r"layers.1.mlp.experts has a forward hook \(<lambda>\)"):
        to_nnef(wrapped, out / "hooked.nnef.tgz")
    handle.remove()
    # accelerate's hooks wrap the forward instead (no torch hook): one that changes the router's output is refused,
    # the device moves device_map dispatch adds everywhere are not
    from accelerate.hooks import AlignDevicesHook, ModelHook, add_hook_to_module, remove_hook_from_module

    class Halving(ModelHook):
        def post_forward(self, module, output):
            return (output[0], output[1] * 0.5, output[2])

    router = hf.model.layers[1].mlp.gate
    add_hook_to_module(router, Halving())
    with pytest.raises(ExportRefused, match=r"layers.1.mlp.gate has a forward hook \(a Halving\)"):
        to_nnef(wrapped, out / "hooked.nnef.tgz")
    add_hook_to_module(router, AlignDevicesHook(execution_device="cpu"))
    assert to_nnef(wrapped.moes[1], out / "moved.nnef.tgz").verification is not None
    remove_hook_from_module(router)
    every = torch.nn.modules.module.register_module_forward_hook(lambda module, args, output: None)
    try:
        with pytest.raises(ExportRefused, match=r"a forward hook registered for every module \(<lambda>"):
            to_nnef(wrapped.moes[1], out / "global.nnef.tgz")
    finally:
        every.remove()


# -- refused families ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "message"),
    [
        ("deepseek_v3", "correction bias .* selection only.*group-limited expert selection"),
        ("mistral4", "group-limited expert selection"),
        ("phimoe", "sparse-mixer"),
        ("zaya", "'skip' class"),
        ("llama4", "does not call its experts as experts"),
        ("flint", "sigmoid scores renormalised"),
        ("gemma4", "not an FFN output"),
        ("dbrx", "not one transformers experts op: dbrx does not call its experts"),
        ("step3p7", "selection only.*renormalised.*activation is clamped after it is applied"),
        ("longcat_flash", "selection only.*zero-compute experts"),
        *[("ergo", "not one transformers experts op: ErgoExperts .* applies each expert's RMSNorm")]
        * ("ergo" in FAMILIES),  # transformers 5.25
    ],
)
def test_families_tract_cannot_express_are_refused(family, message, out):
    whole = ("llama4", "dbrx", "gemma4", "longcat_flash")  # as built (longcat_flash: no num_hidden_layers to cut)
    wrapped = moelens.wrap(small(family) if family not in whole else tiny_model(family))
    path = out / f"{family}.nnef.tgz"
    with pytest.raises(ExportRefused, match=message):
        to_nnef(wrapped, path)
    assert not path.exists()


# -- the user's model, the archive --------------------------------------------------------------------


def test_the_users_model_is_unchanged(out):
    hf = small("qwen2_moe", moe_intermediate_size=32)
    hf.model.layers[0].mlp.gate_proj.weight.requires_grad_(False)
    wrapped = moelens.wrap(hf)
    before = {name: tensor.clone() for name, tensor in hf.state_dict().items()}
    grads = {name: p.requires_grad for name, p in hf.named_parameters()}
    types = {name: type(module) for name, module in hf.named_modules()}
    config = hf.config.to_dict()
    ids = tiny_inputs(hf, batch=1, seq=5)["input_ids"]
    with torch.no_grad():
        logits = hf(input_ids=ids).logits
    to_nnef(wrapped, out / "unchanged.nnef.tgz", example_inputs=ids, edits=Edits(ablate={1: [0]}))
    to_nnef(wrapped.moes[0], out / "unchanged-q40.nnef.tgz", quantize_experts="q4_0", layout="linear")
    after = hf.state_dict()
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert type(after[name]) is torch.Tensor and torch.equal(tensor, after[name]), name
    assert all(type(p) is torch.nn.Parameter for p in hf.parameters())
    assert grads == {name: p.requires_grad for name, p in hf.named_parameters()}
    assert types == {name: type(module) for name, module in hf.named_modules()}
    assert config == hf.config.to_dict()
    with torch.no_grad():
        assert torch.equal(hf(input_ids=ids).logits, logits)


def test_a_model_in_train_mode_exports_and_verifies_as_in_eval_mode(out):
    """The archive is the eval-mode model (no dropout, no router jitter): the export's check and `verify` run torch
    in eval mode, whatever mode the user's model is in, and leave each module's own mode as it was."""
    hf = small("mixtral", attention_dropout=0.5, router_jitter_noise=0.5)
    wrapped = moelens.wrap(hf)
    ids = tiny_inputs(hf, batch=1, seq=8)["input_ids"]
    hidden = torch.randn(1, 8, hf.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(hf.device)
    with torch.no_grad():  # the truth: the model and its block in eval mode
        expected = hf(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        block_expected = hf.model.layers[1].mlp(hidden)
    hf.train()
    hf.model.layers[0].self_attn.eval()  # a mix of modes, each to be left as it is
    modes = {name: module.training for name, module in hf.named_modules()}
    with torch.no_grad():
        assert (hf(input_ids=ids, attention_mask=torch.ones_like(ids)).logits - expected).abs().max() > 1e-2
    report = to_nnef(wrapped, out / "train-mode.nnef.tgz", example_inputs=ids)
    close(run(report.path, ids), expected)
    assert report.verification.meets("approximate") and verify(report.path, wrapped, ids).meets("approximate")
    edited = to_nnef(wrapped, out / "train-mode-edited.nnef.tgz", example_inputs=ids, edits=Edits(ablate={1: [0]}))
    assert edited.verification.meets("approximate") and verify(edited.path, wrapped, ids).meets("approximate")
    block = to_nnef(wrapped.moes[1], out / "train-mode-block.nnef.tgz", example_inputs=hidden)
    close(run(block.path, hidden), block_expected)
    assert block.verification.meets("approximate") and verify(block.path, wrapped.moes[1], hidden).meets("approximate")
    assert modes == {name: module.training for name, module in hf.named_modules()}


def test_export_refuses_a_symbolic_link(out):
    """A link to an earlier export (folder or archive) is refused before any work; link and target stay as they were."""
    moe = moelens.wrap(small("mixtral")).moes[0]
    folder = to_nnef(moe, out / "linked-folder", verify=False).path
    tgz = to_nnef(moe, out / "linked.nnef.tgz", verify=False).path
    before = tgz.read_bytes()
    for target, link in ((folder, out / "folder-link"), (tgz, out / "archive-link.nnef.tgz")):
        link.symlink_to(target.name)
        with pytest.raises(ExportError, match=rf"{link.name}' is a symbolic link \(to '.*{target.name}'\)"):
            to_nnef(moe, link, verify=False)
        assert link.is_symlink() and os.readlink(link) == target.name
    assert tgz.read_bytes() == before and (folder / "graph.nnef").is_file()


def test_archive_has_no_machine_identity_and_is_reproducible(out):
    moe = moelens.wrap(small("olmoe")).moes[1]
    first = to_nnef(moe, out / "identity-a.nnef.tgz", verify=False).path
    second = to_nnef(moe, out / "identity-b.nnef.tgz", verify=False).path
    assert first.read_bytes() == second.read_bytes()
    for member in archive.members(first):
        assert (member.uid, member.gid, member.uname, member.gname, member.mtime) == (0, 0, "", "", 0)
    with tarfile.open(first) as tar:
        text = b"".join(tar.extractfile(m).read() for m in tar.getmembers() if m.name == "graph.nnef").decode()
    for secret in {getpass.getuser(), socket.gethostname(), os.getcwd(), str(Path.home())} - {"", "/"}:
        assert secret not in text
    assert "tract_target_version" in text and '("moelens_kind", "block")' in text
    assert "export_cmd" not in text and "hostname" not in text
    assert f'("py_version", "{platform.python_version()}")' in text  # no build date or compiler


def test_archive_written_as_folder_and_tar(out):
    moe = moelens.wrap(small("mixtral")).moes[0]
    folder = to_nnef(moe, out / "mixtral-folder.nnef").path
    assert (folder / "graph.nnef").is_file() and folder.is_dir()
    tar = to_nnef(moe, out / "mixtral.nnef.tar").path
    assert tarfile.is_tarfile(tar)
    x = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(3))
    close(run(folder, x), run(tar, x), atol=0)


@pytest.mark.parametrize(("named", "message"), [
    ("", r"to_nnef's path is empty: name a file or folder \(an empty path would be the working folder\)"),
    ("{out}/block.nnef.tgz/", r"ends like an archive and with a slash"),  # an archive file was written
    ("{out}/BLOCK.NNEF.TGZ", r"ends like an archive in another case, which would be written as a folder"),
])
def test_an_export_name_that_leaves_archive_or_folder_in_doubt_is_refused(tmp_path, monkeypatch, named, message):
    moe = moelens.wrap(small("mixtral")).moes[0]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ExportError, match=message):
        to_nnef(moe, named.format(out=tmp_path), verify=False)
    assert not list(tmp_path.iterdir())



def test_an_archive_named_with_a_leading_dash_is_checked_like_any_other(tmp_path, monkeypatch):
    """A relative archive name starting with "-" reached tract's command line as an option: the export wrote it and
    then failed its own check, blaming the model. Ground truth: the block's own forward, through tract."""
    moe = moelens.wrap(small("mixtral")).moes[0]
    monkeypatch.chdir(tmp_path)
    result = to_nnef(moe, "-block.nnef.tgz")
    assert result.verification is not None and (tmp_path / "-block.nnef.tgz").is_file()
    x = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(3)).to(moe.device)
    with torch.no_grad():
        close(run("-block.nnef.tgz", x), moe._module(x))

# -- q4_0, layouts, dynamic tokens --------------------------------------------------------------------



def test_export_never_empties_a_folder_of_the_users(out):
    moe = moelens.wrap(small("mixtral")).moes[0]
    project = out / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "work.py").write_text("kept\n")
    with pytest.raises(ExportError, match=r"project' is a folder with files of its own"):
        to_nnef(moe, project, verify=False)
    assert (project / "src" / "work.py").read_text() == "kept\n"
    assert sorted(p.name for p in project.rglob("*")) == ["src", "work.py"]

    earlier = to_nnef(moe, out / "again", verify=False).path  # an earlier export is replaced
    assert to_nnef(moe, earlier, verify=False).path == earlier and (earlier / "graph.nnef").is_file()
    empty = out / "empty"
    empty.mkdir()
    assert (to_nnef(moe, empty, verify=False).path / "graph.nnef").is_file()

    (out / "notes").write_text("kept\n")
    with pytest.raises(ExportError, match=r"notes' is a file"):
        to_nnef(moe, out / "notes", verify=False)
    (out / "folder.nnef.tgz").mkdir()
    with pytest.raises(ExportError, match=r"folder.nnef.tgz' is a folder"):
        to_nnef(moe, out / "folder.nnef.tgz", verify=False)
    assert (out / "notes").read_text() == "kept\n" and not list((out / "folder.nnef.tgz").iterdir())
    assert not list(out.glob("*.part"))


def test_a_folder_export_keeps_the_folder_and_replaces_only_its_files(out, monkeypatch):
    """The folder was deleted and made anew: its mode and owner were lost, and `.` (the current folder) failed
    with Errno 22 after deleting an earlier export in it."""
    moe = moelens.wrap(small("mixtral")).moes[0]
    shared = out / "shared"
    shared.mkdir()
    shared.chmod(0o2775)
    before = shared.stat()
    to_nnef(moe, shared, verify=False)
    to_nnef(moe, shared, verify=False)  # over the earlier export
    after = shared.stat()
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
    assert (shared / "graph.nnef").is_file()

    here = out / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    for _ in range(2):  # into the empty current folder, then over that export
        to_nnef(moe, ".", verify=False)
        assert (here / "graph.nnef").is_file()
    assert here.stat().st_ino == Path.cwd().stat().st_ino


def test_an_archive_export_over_an_earlier_one_keeps_its_mode(out):
    """The renamed temporary file came with the default mode: an archive the user had made private (0600), group
    writable (0664) or read-only (0444) lost that mode when exported to again, while a folder keeps its own."""
    moe = moelens.wrap(small("mixtral")).moes[0]
    for mode in (0o600, 0o664, 0o444):
        archive = to_nnef(moe, out / f"kept-{mode:o}.nnef.tgz", verify=False).path
        archive.chmod(mode)
        to_nnef(moe, archive, verify=False)
        assert stat.S_IMODE(archive.stat().st_mode) == mode
    new = to_nnef(moe, out / "new.nnef.tgz", verify=False).path
    assert stat.S_IMODE(new.stat().st_mode) == 0o666 & ~current_umask()


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_files_of_the_users_beside_an_earlier_export_are_never_deleted(out, monkeypatch):
    """Any *.dat / *.nnef file, at any depth, counted as part of an earlier export: exporting again into that
    folder deleted the user's benchmark results (a whole subfolder). Only graph.nnef, its quantization table and
    the tensors the graph names are an export's. A copy that fails (a full disk) leaves the earlier export."""
    moe = moelens.wrap(small("mixtral")).moes[0]
    folder = to_nnef(moe, out / "kept-export", verify=False).path
    for extra in (folder / "notes.dat", folder / "benchmarks" / "run1.dat", folder / "other.nnef"):
        extra.parent.mkdir(exist_ok=True)
        extra.write_text("the user's\n")
        with pytest.raises(ExportError, match=r"kept-export' is a folder with files of its own"):
            to_nnef(moe, folder, verify=False)
        assert extra.read_text() == "the user's\n"
        extra.unlink()
    with pytest.raises(ExportError, match=r"kept-export' is a folder with files of its own"):  # an empty folder too
        to_nnef(moe, folder, verify=False)
    (folder / "benchmarks").rmdir()
    drafts = out / "only-folders" / "notes" / "drafts"
    drafts.mkdir(parents=True)
    with pytest.raises(ExportError, match=r"only-folders' is a folder with files of its own"):
        to_nnef(moe, out / "only-folders", verify=False)
    assert drafts.is_dir()
    earlier = sorted(p.name for p in folder.iterdir())

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    killed = folder / ".moelens-export-0123456789ab.part"  # what an export killed while copying leaves
    (killed / "graph.nnef").parent.mkdir()
    (killed / "notes.txt").write_text("the user's\n")  # named like one, but holding a file no export has: the user's
    with pytest.raises(ExportError, match=r"kept-export' is a folder with files of its own"):
        to_nnef(moe, folder, verify=False)
    assert (killed / "notes.txt").read_text() == "the user's\n"
    (killed / "notes.txt").unlink()
    (killed / "graph.nnef").write_text("half\n")
    assert to_nnef(moe, folder, verify=False).path == folder and not killed.exists()
    monkeypatch.setattr(archive.shutil, "copytree", full_disk)
    with pytest.raises(ExportError, match=r"writing the export to .*kept-export failed \(\[Errno 28\] No space left "
                                          r"on device\); what was there is left as it was"):
        to_nnef(moe, folder, verify=False)
    assert sorted(p.name for p in folder.iterdir()) == earlier


def test_an_export_path_from_the_home_folder_is_expanded(out, monkeypatch):
    moe = moelens.wrap(small("mixtral")).moes[0]
    monkeypatch.setenv("HOME", str(out / "home"))
    monkeypatch.chdir(out)
    report = to_nnef(moe, "~/block.nnef.tgz", verify=False)
    assert report.path == out / "home" / "block.nnef.tgz" and report.path.is_file() and not (out / "~").exists()


def test_a_folder_that_may_not_be_written_into_is_refused_before_the_export(read_only_folder):
    moe = moelens.wrap(small("mixtral")).moes[0]
    with pytest.raises(ExportError, match="read-only' is a folder this user may not write into"):
        to_nnef(moe, read_only_folder, verify=False)
    with pytest.raises(ExportError, match="lies under .*read-only', a folder this user may not write into"):
        to_nnef(moe, read_only_folder / "block.nnef.tgz", verify=False)
    # an existing folder that may be written into is written into, whatever lies above it (it was refused)
    assert to_nnef(moe, read_only_folder / "writable", verify=False).path == read_only_folder / "writable"
    assert (read_only_folder / "writable" / "graph.nnef").is_file()


def test_export_never_replaces_a_file_of_the_users(out):
    moe = moelens.wrap(small("mixtral")).moes[0]
    (out / "kept.txt").write_text("kept\n")
    user = out / "backup.tar"
    with tarfile.open(user, "w") as tar:
        tar.add(out / "kept.txt", arcname="kept.txt")
    before = user.read_bytes()
    with pytest.raises(ExportError, match=r"backup.tar' is a file that is not an NNEF export"):
        to_nnef(moe, user, verify=False)
    assert user.read_bytes() == before

    earlier = to_nnef(moe, out / "earlier.nnef.tgz", verify=False).path  # an earlier export archive is replaced
    assert to_nnef(moe, earlier, verify=False).path == earlier and "tract_moe_ffn" in archive.graph_text(earlier)
    (out / "touched.tar").touch()  # so is an empty file
    assert "tract_moe_ffn" in archive.graph_text(to_nnef(moe, out / "touched.tar", verify=False).path)

    for under_a_file in (out / "kept.txt" / "x.nnef.tgz", out / "kept.txt" / "deeper" / "folder"):
        with pytest.raises(ExportError, match=r"kept.txt', which is a file, not a folder"):
            archive.check_destination(under_a_file)  # what to_nnef checks before any work
    assert (out / "kept.txt").read_text() == "kept\n"

    # the archive is written beside itself under a name of its own: files and links named like "<archive>.part" stay
    (out / "notes.nnef.tgz.part").write_text("kept\n")
    (out / "linked.nnef.tgz.part").symlink_to("kept.txt")
    for name in ("notes.nnef.tgz", "linked.nnef.tgz"):
        assert "tract_moe_ffn" in archive.graph_text(to_nnef(moe, out / name, verify=False).path)
    assert (out / "notes.nnef.tgz.part").read_text() == "kept\n" and (out / "kept.txt").read_text() == "kept\n"
    assert os.readlink(out / "linked.nnef.tgz.part") == "kept.txt"
    assert not [p.name for p in out.glob(".*.part")]  # no temporary file is left


def test_a_q4_0_check_where_torch_computes_nan_is_refused(out, monkeypatch):
    """The Q4_0 check compares tract with torch run on the archive's dequantized weights: NaN there against NaN in
    tract counted as a match."""
    from moelens.export import extractor

    real = extractor.dequantized

    def poisoned(module):
        spec = real(module)
        return spec.with_weights(w2=torch.full_like(spec.w2, float("nan")))

    monkeypatch.setattr(extractor, "dequantized", poisoned)
    moe = moelens.wrap(small("mixtral", intermediate_size=32)).moes[0]
    with pytest.raises(ExportError, match=r"torch computes NaN with the archive's dequantized Q4_0 expert weights"):
        to_nnef(moe, out / "q40-nan.nnef.tgz", quantize_experts="q4_0")


@pytest.mark.parametrize("layout", ["canonical", "linear"])
def test_q4_0_experts(layout, out):
    moe = moelens.wrap(small("mixtral", intermediate_size=32)).moes[0]
    float_report = to_nnef(moe, out / f"f32-{layout}.nnef.tgz", layout=layout)
    report = to_nnef(moe, out / f"q40-{layout}.nnef.tgz", quantize_experts="q4_0", layout=layout)
    assert report.bytes < float_report.bytes * 0.6
    for path in (report.path, float_report.path):
        assert ("expert_layout = 'linear'" in tract_moe_calls(path)[0]) == (layout == "linear")
    with pytest.raises(ExportRefused, match="multiples of 32"):  # the tiny expert size is 16
        to_nnef(moelens.wrap(small("mixtral")).moes[0], out / "q40-16.nnef.tgz", quantize_experts="q4_0")
    check = report.verification
    assert check.details["export_tolerance"] in ("close", "approximate")  # tract's Q4_0 == torch with the same weights
    assert check.max_abs_error > check.details["export_max_abs_error"]  # vs float32: quantisation error
    assert float_report.verification.meets("approximate")


def test_dynamic_tokens_block(out):
    wrapped = moelens.wrap(small("qwen2_moe"))
    moe = wrapped.moes[0]
    report = to_nnef(moe, out / "dynamic.nnef.tgz", dynamic_tokens=True)
    assert "extension tract_symbol S;" in archive.graph_text(report.path)
    for tokens in (1, 5, 17):
        hidden = torch.randn(1, tokens, 32, generator=torch.Generator().manual_seed(tokens))
        with torch.no_grad():
            close(run(report.path, hidden), moe._module(hidden))
    assert report.verification.details["second_length"]["tokens"] == 2 * 8 + 3


@pytest.mark.parametrize("family", KNOWN_TO_T2N + UNKNOWN_TO_T2N_MODELS)
def test_dynamic_tokens_model(family, out):
    """One archive runs every length, beyond gpt_oss' / cohere2_moe's sliding window (16) too."""
    hf = small(family)
    report = to_nnef(moelens.wrap(hf), out / f"dynamic-{family}.nnef.tgz", dynamic_tokens=True,
                     example_inputs=tiny_inputs(hf, batch=2, seq=5)["input_ids"])
    assert "extension tract_symbol S;" in archive.graph_text(report.path)
    assert report.verification.details["second_length"]["tolerance"] in ("close", "approximate")
    for tokens in (1, 9, 23):
        ids = tiny_inputs(hf, batch=2, seq=tokens, seed=tokens)["input_ids"]
        with torch.no_grad():
            output = hf(input_ids=ids, attention_mask=torch.ones_like(ids))
        close(run(report.path, ids), output.logits if hasattr(output, "logits") else output.last_hidden_state)


def test_dynamic_archives_second_length_stays_within_the_positions():
    from moelens.export.target import resolve
    from moelens.export.verification import second_length

    target = resolve(moelens.wrap(small("mixtral", max_position_embeddings=64)))
    assert [second_length(target, tokens) for tokens in (5, 40, 64)] == [13, 64, 32]


def test_dynamic_tokens_with_q4_0_experts(out):
    """A dynamic whole-model archive with Q4_0 experts matches torch on the same Q4_0 weights at both lengths."""
    model = moelens.load()
    ids = torch.randint(3, model._module.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    report = to_nnef(model, out / "dynamic-q40.nnef.tgz", example_inputs=ids, dynamic_tokens=True,
                     quantize_experts="q4_0", layout="linear")
    details = report.verification.details
    assert details["export_tolerance"] in ("close", "approximate")
    assert details["second_length"]["tokens"] == 15
    assert details["second_length"]["export_tolerance"] in ("close", "approximate")
    assert details["second_length"]["max_abs_error"] > 10 * details["second_length"]["export_max_abs_error"]


def test_a_q4_0_model_s_check_tests_its_edits(out, monkeypatch):
    """The Q4_0 check compares tract with torch on the archive's own (baked, dequantized) weights, so an edit baked
    wrong passed it (the comparison with the edits made in a trace, which Q4_0's error swamps, was only recorded).
    The float32 weights with the edits baked in are checked against the trace too. Ground truth: a bake made to
    forget its ablation, which a float32 export's check catches."""
    from moelens.export import edits as edits_module

    model = moelens.wrap(small("mixtral", intermediate_size=32))
    ids = torch.randint(3, 64, (1, 10), generator=torch.Generator().manual_seed(0))
    edits = Edits(route_around={1: [0, 3]}, ablate={1: [7, 6]}, steer={0: {2: 2.0}})
    report = to_nnef(model, out / "q40-edited.nnef.tgz", example_inputs=ids, edits=edits, quantize_experts="q4_0")
    assert report.verification.details["edits_tolerance"] in ("super", "very", "close", "approximate")
    real = edits_module.Edits.bake

    def forgets_ablation(self, spec):
        baked = real(self, spec)
        for expert in self.ablate.get(spec.layer, ()):
            baked.w2[expert] = spec.w2[expert]
        return baked

    monkeypatch.setattr(edits_module.Edits, "bake", forgets_ablation)
    for quantize in (None, "q4_0"):
        with pytest.raises(ExportError, match=r"differ"):
            to_nnef(model, out / f"forgot-{quantize}.nnef.tgz", example_inputs=ids, edits=edits,
                    quantize_experts=quantize)


def test_dynamic_tokens_refuses_layers_without_a_rebuilt_mask(out):
    with pytest.raises(ExportRefused, match="linear_attention"):
        to_nnef(moelens.wrap(small("qwen3_next")), out / "dynamic-qwen3_next.nnef.tgz", dynamic_tokens=True)


@pytest.mark.parametrize("family, kinds", [
    ("gpt_oss", {"full_attention", "sliding_attention"}),  # layer_types: a mask per type
    ("mixtral", {"sliding_attention"}),  # no layer_types, a sliding_window: every layer slides
    ("mellum", {"full_attention"}),
])
def test_export_masks_equal_transformers_masks(family, kinds):
    """The tensor-op masks of a dynamic export equal transformers' own eager masks, per layer type."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    from moelens.export.masks import attention_masks, positions

    config = small(family, **({"sliding_window": 4} if family == "mixtral" else {})).config
    config._attn_implementation = "eager"
    ids = torch.ones(2, 21, dtype=torch.long)
    built = attention_masks(config, positions(ids))
    masks = built if isinstance(built, dict) else {next(iter(kinds)): built}
    assert set(masks) == kinds
    made_by = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
    for kind, mask in masks.items():
        # The cache argument by position: transformers 5.24 renames it (past_key_values -> cache).
        expected = made_by[kind](config, torch.zeros(2, 21, config.hidden_size), torch.ones_like(ids), None,
                                 allow_is_causal_skip=False)
        assert mask.shape == expected.shape and torch.equal(mask == 0, expected == 0), kind


def test_verify_takes_the_archives_batch(out):
    """verify without inputs builds them in the archive's traced shape, batch included."""
    hf = small("olmoe")
    wrapped = moelens.wrap(hf)
    report = to_nnef(wrapped, out / "batch2.nnef.tgz", example_inputs=tiny_inputs(hf, batch=2, seq=6)["input_ids"],
                     verify=False)
    assert verify(report.path, wrapped).meets("approximate")


def test_example_inputs_take_an_all_ones_mask_only(out):
    """The archive takes input_ids only and attends every token: a mapping may carry an all-ones attention_mask;
    a padding mask (which the archive would ignore), another input or ids that are no numbers are refused,
    with nothing written."""
    hf = small("mixtral")
    wrapped = moelens.wrap(hf)
    inputs = tiny_inputs(hf, batch=2, seq=6)  # input_ids and an all-ones attention_mask
    report = to_nnef(wrapped, out / "mask-ones.nnef.tgz", example_inputs=inputs)
    with torch.no_grad():
        close(run(report.path, inputs["input_ids"]), hf(**inputs).logits)
    padding = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    refused = {
        r"attention_mask \(shape \(2, 6\)\) is not all ones": {**inputs, "attention_mask": padding},
        r"holds \['token_type_ids'\].*takes input_ids only": {**inputs, "token_type_ids": torch.zeros(2, 6)},
        r"has no 'input_ids'": {"attention_mask": inputs["attention_mask"]},
        r"is torch.bool of shape \(1, 4\)": torch.ones(1, 4, dtype=torch.bool),
        r"numpy array of object, not numbers": np.array([[5, None]], dtype=object),
    }
    for message, given in refused.items():
        path = out / "mask-refused.nnef.tgz"
        with pytest.raises(ExportError, match=message):
            to_nnef(wrapped, path, example_inputs=given)
        assert not path.exists()


def with_values(hidden: torch.Tensor, places: list[tuple[int, int]], values: list[float]) -> torch.Tensor:
    """``hidden`` [1, seq, D] with ``values`` at the (token, channel) ``places``."""
    for (token, channel), value in zip(places, values):
        hidden[0, token, channel] = value
    return hidden


def test_block_example_inputs_are_batched_hidden_states_of_its_width(out):
    moe = moelens.wrap(small("mixtral")).moes[0]
    path = out / "block-inputs.nnef.tgz"
    refused = {
        r"hidden states \[batch, seq, D\].*shape \(5, 32\); add the batch axis": torch.randn(5, 32),
        r"shape \(1, 5, 16\) do not fit the block.*\[batch, seq, 32\] \(axis 2 must be 32\)": torch.randn(1, 5, 16),
        r"hidden states \[batch, seq, D\] \(floats\)": torch.ones(1, 5, 32, dtype=torch.long),
        r"hold 2 NaN or infinite values \(as float32\).*Pass finite hidden states": with_values(
            torch.randn(1, 5, 32), [(1, 0), (4, 7)], [float("nan"), -float("inf")]),
        r"hold 1 NaN or infinite values \(as float32\)": with_values(  # finite as float64, not as float32
            torch.randn(1, 5, 32, dtype=torch.float64), [(3, 5)], [1e39]),
    }
    for message, hidden in refused.items():
        with pytest.raises(ExportError, match=message):
            to_nnef(moe, path, example_inputs=hidden)
        assert not path.exists()


def test_verify_and_run_cast_and_check_their_inputs(out):
    """verify and run take what to_nnef takes (int32 ids, numpy arrays), and name a wrong shape, dtype or token id."""
    hf = small("mixtral")
    wrapped = moelens.wrap(hf)
    ids = tiny_inputs(hf, batch=2, seq=6)["input_ids"].int()
    report = to_nnef(wrapped, out / "int32.nnef.tgz", example_inputs=ids)
    with torch.no_grad():
        expected = hf(input_ids=ids.long(), attention_mask=torch.ones_like(ids)).logits
    for given in (ids, ids.numpy(), ids.long().numpy()):
        close(run(report.path, given), expected)
        assert verify(report.path, wrapped, given).meets("approximate")
    refused = {
        r"shape \(1, 6\) do not fit the archive .*int32.nnef.tgz, which takes the shape \[2, 6\] \(axis 0 must be 2\)":
            ids[:1],
        r"\(axis 1 must be 6\)": tiny_inputs(hf, batch=2, seq=7)["input_ids"],
        r"token id 500, outside the model's vocabulary \[0, 128\)": torch.full((2, 6), 500),
        r"token id -1, outside": torch.full((2, 6), -1).numpy(),
        r"takes token ids \[batch, seq\] \(integers\), but inputs is torch.float32": torch.randn(2, 6),
    }
    for message, given in refused.items():
        with pytest.raises(ExportError, match=message):
            run(report.path, given)
        with pytest.raises(ExportError, match=message):
            verify(report.path, wrapped, given)
    moe = wrapped.moes[0]  # a dynamic block archive: any length, its traced batch and its D
    block = to_nnef(moe, out / "dynamic-block-inputs.nnef.tgz", dynamic_tokens=True, verify=False)
    hidden = np.random.default_rng(0).standard_normal((1, 11, 32))  # float64: cast to float32
    with torch.no_grad():
        close(run(block.path, hidden), moe._module(torch.from_numpy(hidden).float()))
    assert verify(block.path, moe, hidden).meets("approximate")
    with pytest.raises(ExportError, match=r"takes the shape \[1, S, 32\] \(axis 2 must be 32\)"):
        run(block.path, hidden[..., :16])
    with pytest.raises(ExportError, match=r"\(axis 0 must be 1\)"):
        verify(block.path, moe, np.concatenate([hidden, hidden]))


def test_a_check_where_torch_computes_nan_is_refused_not_passed(out):
    """Finite hidden states far beyond the model's scale make torch compute NaN; NaN against NaN counted as a match,
    so to_nnef's check and verify passed at 'exact' while comparing nothing."""
    moe = moelens.wrap(small("mixtral")).moes[0]
    huge = torch.full((1, 5, 32), 1e30)
    with torch.no_grad():
        assert torch.isnan(moe._module(huge)).any()  # what the check would have compared
    message = r"the block \(torch, float32\) computes NaN at \d+ of its 160 output values for the inputs of shape \(1, 5, 32\)"
    with pytest.raises(ExportError, match=message):
        to_nnef(moe, out / "huge.nnef.tgz", example_inputs=huge)
    report = to_nnef(moe, out / "finite.nnef.tgz", example_inputs=torch.randn(1, 5, 32))
    with pytest.raises(ExportError, match=message):
        verify(report.path, moe, huge)


def test_verify_reports_mismatch(out):
    wrapped = moelens.wrap(small("mixtral"))
    report = to_nnef(wrapped, out / "verify.nnef.tgz")
    assert report.verification.tolerance in ("close", "approximate")
    other = moelens.wrap(small("mixtral", seed=1))
    mismatch = verify(report.path, other)
    assert mismatch.max_abs_error > 1e-3 and not mismatch.meets("approximate")
    with pytest.raises(ExportError, match=r"is a model export but a block was given to compare it with; give the whole model it was exported from"):
        verify(report.path, wrapped.moes[0])


def test_verify_refuses_a_model_the_archive_was_not_exported_from(out):
    """A model of another vocabulary, family or width is named as such (not a tract panic or a torch error)."""
    wrapped = moelens.wrap(small("mixtral"))
    model = to_nnef(wrapped, out / "model.nnef.tgz", verify=False).path
    block = to_nnef(wrapped.moes[0], out / "block.nnef.tgz", verify=False).path
    larger = moelens.wrap(small("mixtral", vocab_size=512))
    for inputs in (None, torch.full((1, 8), 400)):  # ids the archive's embedding cannot take
        with pytest.raises(ExportError, match=r"model.nnef.tgz was exported from a model of vocabulary size 128, but "
                                              r"the model given has vocabulary size 512"):
            verify(model, larger, inputs)
    wider = moelens.wrap(small("mixtral", hidden_size=64, head_dim=16)).moes[0]
    for inputs in (None, torch.randn(1, 8, 32)):
        with pytest.raises(ExportError, match=r"block of hidden size 32, but the block given has hidden size 64"):
            verify(block, wider, inputs)
    with pytest.raises(ExportError, match=r"block of family mixtral, but the block given has family olmoe"):
        verify(block, moelens.wrap(small("olmoe")).moes[0])
    # another layer's block of the same model: compared, it read as a broken export (an error of 1.5, no level met)
    with pytest.raises(ExportError, match=r"block.nnef.tgz was exported from a block of MoE layer\(s\) 0, but the "
                                          r"block given has MoE layer\(s\) 1"):
        verify(block, wrapped.moes[1])
    assert verify(block, wrapped._module.model.layers[0].mlp).meets("approximate")  # a bare module: no layer known


def test_verify_refuses_a_model_routing_another_k_than_the_archive(out):
    """An archive exported under moelens.set_top_k, verified without it (or the reverse), read as a broken export."""
    wrapped = moelens.wrap(small("mixtral"))
    with moelens.set_top_k(wrapped, 3):
        model = to_nnef(wrapped, out / "k3.nnef.tgz", verify=False).path
        block = to_nnef(wrapped.moes[1], out / "k3-block.nnef.tgz", verify=False).path
    plain = to_nnef(wrapped, out / "k2.nnef.tgz", verify=False).path
    for archive, given, archived, now in ((model, wrapped, "3,3", "2,2"), (block, wrapped.moes[1], "3", "2")):
        with pytest.raises(ExportError, match=rf"routes {archived} experts per token \(the k of its MoE layers\), but "
                                              rf"the (model|block) given routes {now} now; verify it at the k"):
            verify(archive, given)
        with moelens.set_top_k(wrapped, 3):
            assert verify(archive, given).meets("approximate")
    with moelens.set_top_k(wrapped, 1), pytest.raises(ExportError, match=r"routes 2,2 experts .* given routes 1,1 now"):
        verify(plain, wrapped)


def test_verify_matches_a_block_wherever_its_model_was_wrapped(out):
    """A block archive records its block's path (to tell apart blocks of one layer), but verify compared the whole
    path, which starts where the wrapping starts: layer 1's block of a causal LM exported from moelens.wrap(lm) and
    verified against moelens.wrap(lm.model).moes[1] (the very same module) was refused (path model.model.layers.1.mlp
    vs model.layers.1.mlp). Another block of that layer, or of the same layer index in another stack, still is."""
    from test_compress_helpers import convert, ids, llama

    from moelens.compress import exportable

    lm = small("mixtral")
    hidden = torch.randn(1, 8, lm.config.hidden_size, generator=torch.Generator().manual_seed(3))
    whole, base = moelens.wrap(lm).moes[1], moelens.wrap(lm.model).moes[1]
    assert base._module is whole._module and base.path != whole.path
    for exported, given in ((whole, base), (base, whole)):
        archive_path = to_nnef(exported, out / f"wrapped-{exported.path}.nnef.tgz", verify=False).path
        with torch.no_grad():
            close(run(archive_path, hidden), lm.model.layers[1].mlp(hidden))  # the archive is this block
        assert verify(archive_path, given, hidden).meets("approximate")

    # another block of one layer (attention projections converted by compress), exported and given wrapped differently
    converted = exportable(convert(llama(kv_heads=4), calibration=ids(), num_experts=4, top_k=2,
                                   target_attention_only=True)[0])
    value = next(moe for moe in moelens.wrap(converted).moes if moe.path.endswith("layers.0.self_attn.v_proj"))
    query = next(moe for moe in moelens.wrap(converted.model).moes if moe.path.endswith("layers.0.self_attn.q_proj"))
    archive_path = to_nnef(value, out / "v_proj-wrapped.nnef.tgz", verify=False).path
    with pytest.raises(ExportError, match=r"exported from a block of path model\.model\.layers\.0\.self_attn\.v_proj, "
                                          r"but the block given has path model\.layers\.0\.self_attn\.q_proj, another"):
        verify(archive_path, query, hidden)

    # layer 0 of two stacks under one root: the same layer index, hidden size and family, another block
    root = torch.nn.Module()
    root.first, root.second = small("mixtral", num_hidden_layers=1), small("mixtral", num_hidden_layers=1, seed=1)
    stacks = moelens.wrap(root).moes
    archive_path = to_nnef(stacks[0], out / "first-stack.nnef.tgz", verify=False).path
    assert verify(archive_path, moelens.wrap(root.first).moes[0], hidden).meets("approximate")  # wrapped alone
    with pytest.raises(ExportError, match=r"block of path model\.first\.model\.layers\.0\.mlp, but the block given "
                                          r"has path model\.second\.model\.layers\.0\.mlp, another block"):
        verify(archive_path, stacks[1], hidden)


def test_export_refuses_to_run_inside_a_trace(out):
    wrapped = moelens.wrap(small("mixtral"))
    ids = torch.randint(3, 128, (1, 6))
    exported = to_nnef(wrapped, out / "outside.nnef.tgz", verify=False).path
    before = {name: p.detach().clone() for name, p in wrapped._module.named_parameters()}
    for export in (lambda: to_nnef(wrapped, out / "inside.nnef.tgz"), lambda: verify(exported, wrapped)):
        with pytest.raises(ExportError, match=r"cannot do from inside a trace .* Call it after the with-block"):
            with wrapped.trace(ids):
                moelens.ablate(wrapped.moes[0], 1, "route_around")
                export()
    assert not (out / "inside.nnef.tgz").exists()
    assert all(torch.equal(p, before[name]) for name, p in wrapped._module.named_parameters())
    with wrapped.trace(ids):  # the model still runs
        logits = wrapped.output.logits.save()
    assert logits.shape == (1, 6, 128)


def test_compare_counts_matching_nans_and_infinities_as_equal():
    from moelens.export.verification import _compare

    torch_side = np.array([1.0, np.nan, np.inf, -np.inf], dtype=np.float32)
    same = _compare(torch_side.copy(), torch_side, "torch")
    assert same.max_abs_error == 0.0 and same.tolerance == "exact"
    off = _compare(np.array([1.05, np.nan, np.inf, -np.inf], dtype=np.float32), torch_side, "torch")
    assert off.max_abs_error == pytest.approx(0.05) and off.tolerance == "very"
    stray = _compare(np.array([1.0, 0.0, np.inf, -np.inf], np.float32), torch_side, "torch")
    assert stray.tolerance is None and stray.details == {}  # NaN in torch only: no level; tract computed numbers
    tract_nan = _compare(np.array([1.5, np.nan, np.inf, np.nan], np.float32), torch_side, "torch")
    # NaN where torch has a number is counted apart, and hides no finite error
    assert tract_nan.max_abs_error == pytest.approx(0.5) and tract_nan.details == {"tract_nan": 1}
    assert tract_nan.tolerance is None


def test_verify_names_a_missing_or_broken_archive(out):
    wrapped = moelens.wrap(small("mixtral"))
    with pytest.raises(ExportError, match=r"missing.nnef.tgz does not exist"):
        verify(out / "missing.nnef.tgz", wrapped)
    (out / "broken.nnef.tgz").write_bytes(b"not an archive")
    with pytest.raises(ExportError, match=r"broken.nnef.tgz is not an NNEF export"):
        verify(out / "broken.nnef.tgz", wrapped)


# -- the tract command-line stand-in ------------------------------------------------------------------


def test_tract_cli_standin_checks_outputs(out):
    from moelens.export.runner import tract_module
    from moelens.export.tract_cli import standin_path

    moe = moelens.wrap(small("mixtral")).moes[0]
    path = to_nnef(moe, out / "standin.nnef.tgz", verify=False).path
    tract = str(standin_path())
    version = subprocess.run([tract, "--version"], capture_output=True, text=True).stdout.split()
    assert version == ["tract", tract_module().version()]
    hidden = np.random.default_rng(0).standard_normal((1, 8, 32)).astype(np.float32)
    with torch.no_grad():
        good = moe._module(torch.from_numpy(hidden)).numpy()
    np.savez(out / "in.npz", hidden_states=hidden)
    for name, expected, ok in (("good", good, True), ("bad", good + 1e-2, False)):
        np.savez(out / f"{name}.npz", mlp_output=expected)
        done = subprocess.run(
            [tract, str(path), "--nnef-tract-core", "--nnef-tract-transformers", "-O", "run", "--input-from-bundle",
             str(out / "in.npz"), "--assert-output-bundle", str(out / f"{name}.npz"), "--approx", "approximate"],
            capture_output=True, text=True,
        )
        assert ("ERROR" not in done.stderr) == ok, done.stderr


# -- the command line ---------------------------------------------------------------------------------


def test_cli_exports_a_checkpoint_with_edits(out, capsys):
    from moelens.cli import main

    folder = out / "checkpoint"
    small("qwen3_moe").save_pretrained(folder)
    archive_path = out / "cli.nnef.tgz"
    status = main(["export", str(folder), str(archive_path), "--tokens", "6", "--steer", "1:2=1.5", "--ablate", "1:0,3",
                   "--dynamic-tokens"])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "tract_moe_ffn(E=8, k=2, gate=softmax_all" in printed and "steer 2+1.5; ablate [0, 3]" in printed
    assert "tract tolerance: close, 2 of 6" in printed or "tract tolerance: approximate, 3 of 6" in printed
    assert re.search(r"at 15 tokens: \S+ \((close|approximate), \d of 6 from the tightest\)", printed)  # the dynamic archive, edited, at 2 * 6 + 3
    assert main(["export", str(folder), str(out / "x.nnef.tgz"), "--steer", "1:2"]) == 2
    assert "expected LAYER:EXPERT=BIAS, e.g. 2:4=1.5" in capsys.readouterr().err
    assert main(["export", str(folder), str(out / "x.nnef.tgz"), "--block", "0"]) == 2  # layer 0 is dense
    assert "no MoE block there" in capsys.readouterr().err


def test_cli_keeps_transformers_quiet(out):
    """No "Loading weights" bar and no transformers warning (``loss_type=None``) in the command's output."""
    script = Path(sys.executable).parent / "moelens"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "moelens.cli"]
    result = subprocess.run(command + ["export", "tiny", str(out / "quiet.nnef.tgz"), "--no-verify", "--tokens", "2"],
                            capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    assert "Loading weights" not in result.stderr and "transformers" not in result.stderr and "wrote" in result.stdout


def test_cli_says_when_no_tolerance_is_met(out, monkeypatch, capsys):
    from moelens.cli import main
    from moelens.export import exporter
    from moelens.export.verification import Verification

    def exported(model, path, **options):  # an archive whose check met none of tract's levels
        check = Verification(max_abs_error=0.5, tolerance=None, reference="the model (torch, float32)")
        return exporter.ExportReport(path=Path(path), kind="model", blocks=[], input_name="input_ids",
                                     output_name="logits", seconds=0.0, bytes=0, verification=check)

    monkeypatch.setattr(exporter, "to_nnef", exported)
    assert main(["export", "tiny", str(out / "none.nnef.tgz"), "--tokens", "2"]) == 0
    assert "(tract tolerance: none met)" in capsys.readouterr().out


# -- the family table -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def table_rows():
    """The family table's rows (each family's tiny model built and its first MoE block checked once)."""
    from moelens.export.table import rows

    return rows()


def test_docs_family_table_is_current(table_rows):
    from moelens.export.table import END, START, render
    from moelens.testing.tiny import UNBUILDABLE

    if UNBUILDABLE:
        pytest.skip(f"docs/export.md is generated with transformers 5.25 (here: {', '.join(UNBUILDABLE.values())})")

    text = (ROOT / "docs" / "export.md").read_text()
    committed = text.split(START, 1)[1].split(END, 1)[0].strip("\n")
    assert committed == render(table_rows).strip("\n"), (
        "docs/export.md's family table is stale: run `python -m moelens.export.table --write docs/export.md`"
    )


def test_cohere2_sigmoid_scores_export_only_without_renormalisation(out):
    """The table's condition for cohere2_moe is complete: a sigmoid exports only with norm_topk_prob off."""
    from moelens.export.gate import family_support
    from moelens.families import registry

    condition = family_support(registry.get("cohere2_moe")).condition
    assert "is softmax, or is sigmoid and not router.norm_topk_prob" in condition
    renormalised = moelens.wrap(small("cohere2_moe", expert_selection_fn="sigmoid", norm_topk_prob=True)).moes[0]
    with pytest.raises(ExportRefused, match="sigmoid scores renormalised"):
        to_nnef(renormalised, out / "cohere2-sigmoid-norm.nnef.tgz")
    hf = small("cohere2_moe", expert_selection_fn="sigmoid", norm_topk_prob=False)
    moe = moelens.wrap(hf).moes[0]
    hidden = torch.randn(1, 6, hf.config.hidden_size, generator=torch.Generator().manual_seed(2))
    report = to_nnef(moe, out / "cohere2-sigmoid.nnef.tgz", example_inputs=hidden)
    assert report.blocks[0].gate == "sigmoid"
    with torch.no_grad():
        expected = moe._module(hidden)
    close(run(report.path, hidden), expected[0] if isinstance(expected, tuple) else expected)


def test_table_agrees_with_what_exports(table_rows):
    """Every family the table says exports (with a tiny model) is exported and run in tract by
    `test_block_export_matches_torch_in_tract`; every family it says does not is refused."""
    from moelens.export.exporter import prepare
    from moelens.export.target import resolve
    from moelens.testing import FAMILIES

    exporting = {row.family for row in table_rows if row.exports == "yes" and row.family in FAMILIES}
    unchecked = sorted(exporting - set(BLOCK_FAMILIES))
    assert not unchecked, f"the table says {unchecked} export, but no test runs them in tract: add them to MORE_BLOCKS"
    for row in table_rows:
        if row.family not in FAMILIES or row.exports != "no":
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            target = resolve(tiny_model(row.family))
        with pytest.raises(ExportRefused):
            prepare(target)


def test_a_tract_load_failure_names_its_cause(out):
    """tract cannot fold openai_privacy_filter's abs of a symbolic length: the error said only 'opening file'."""
    wrapped = moelens.wrap(tiny_model("openai_privacy_filter"))
    with pytest.raises(ExportError, match=r"opening file .*caused by: 0: running pass .*Abs does not support TDim"):
        to_nnef(wrapped, out / "privacy_filter.nnef.tgz")


def test_export_under_deprecation_warnings_as_errors(tmp_path):
    """torch-to-nnef's import uses APIs torch deprecates (torch.jit.script_method): under -W error it failed the
    export, and the command printed torch's warning as its own."""
    script = ("import moelens, moelens.export as e\n"
              f"e.to_nnef(moelens.load().moes[0], {str(tmp_path / 'block.nnef.tgz')!r}, verify=False)\n")
    done = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-W", "error::FutureWarning", "-c", script],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "block.nnef.tgz").is_file()
