"""Contracts of the NNEF export that the wider export tests leave unpinned.

Each test checks one documented promise against an independent ground truth: the real transformers
block (for the reference maths `MoeSpec.routed` that every block is checked against), hand-built
inputs at the edge of a documented bound (the vocabulary, the self-check's 1e-5), or the archive
writer's own files. Most stop before tracing (refusals, checks of inputs) so they run in well under a
second; the few exports use ``verify=False`` or tiny blocks. Needs the ``export`` extra.
"""

from __future__ import annotations

import copy
import gzip
import tarfile
import tempfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("torch_to_nnef", reason="the export extra is not installed (pip install 'moelens[export]')")
pytest.importorskip("tract", reason="the export extra is not installed (pip install 'moelens[export]')")

import moelens  # noqa: E402
from moelens.export import Edits, ExportError, ExportRefused, to_nnef  # noqa: E402
from moelens.export import archive  # noqa: E402
from moelens.testing import tiny_inputs, tiny_model  # noqa: E402
from test_export import small  # noqa: E402


# -- inputs -----------------------------------------------------------------------------------------


def test_default_token_ids_are_seeded_and_skip_the_special_ids():
    """The default example inputs are seeded ``[1, 8]`` token ids drawn from ``3 .. vocab-1`` (never 0..2: pad,
    bos, eos), and a block's are ``[1, 8, D]`` hidden states."""
    from moelens.export.exporter import default_inputs
    from moelens.export.target import resolve

    wrapped = moelens.wrap(small("mixtral"))  # vocabulary 128
    target = resolve(wrapped)
    context = wrapped.config.max_position_embeddings
    ids = default_inputs(target, tokens=context, batch=32)  # enough draws that each id of 0..127 comes up (~32 times)
    assert ids.shape == (32, context) and ids.dtype == torch.long
    assert int(ids.min()) == 3 and int(ids.max()) == 127
    assert torch.equal(default_inputs(target), default_inputs(target))
    block = default_inputs(resolve(wrapped.moes[0]))
    assert block.shape == (1, 8, 32) and block.dtype == torch.float32


def test_token_ids_are_checked_against_the_vocabulary_at_its_edge():
    """Ids must lie in ``[0, vocab)``: the last id passes, ``vocab`` itself is refused (one past the embedding)."""
    from moelens.export.exporter import checked_inputs

    assert int(checked_inputs(torch.full((1, 4), 127), "model", vocab=128).max()) == 127
    with pytest.raises(ExportError, match=r"token id 128, outside the model's vocabulary \[0, 128\)"):
        checked_inputs(torch.full((1, 4), 128), "model", vocab=128)
    with pytest.raises(ExportError, match=r"token id -1, outside"):
        checked_inputs(torch.tensor([[5, -1]]), "model", vocab=128)


def test_a_block_archive_refusal_gives_the_advice_that_fits_the_input():
    """Unbatched float states are told to add the batch axis; token ids are told the block takes hidden states."""
    from moelens.export.exporter import checked_inputs

    with pytest.raises(ExportError, match=r"of shape \(5, 32\); add the batch axis to unbatched \[seq, D\] states"):
        checked_inputs(torch.ones(5, 32), "block")
    with pytest.raises(ExportError, match=r"torch.int64 of shape \(1, 5\): pass the float hidden states") as refused:
        checked_inputs(torch.ones(1, 5, dtype=torch.long), "block")
    assert "x[None]" not in str(refused.value)
    with pytest.raises(ExportError, match=r"torch.int64 of shape \(1, 5, 32\); pass them as floats"):
        checked_inputs(torch.ones(1, 5, 32, dtype=torch.long), "block")


def test_inputs_of_another_rank_than_the_archive_declares_are_refused():
    """An archive that records no kind (``kind=None``) still has its input shape checked, rank included."""
    from moelens.export.exporter import checked_inputs

    assert checked_inputs(torch.ones(1, 4), None, dims=[1, "S"]).shape == (1, 4)
    with pytest.raises(ExportError, match=r"shape \(1, 4, 1\) do not fit the export, which takes the shape \[1, S\]"):
        checked_inputs(torch.ones(1, 4, 1), None, dims=[1, "S"])
    with pytest.raises(ExportError, match=r"shape \(1,\) do not fit"):
        checked_inputs(torch.ones(1), None, dims=[1, "S"])


def test_model_example_inputs_must_be_two_dimensional_and_hold_a_token(tmp_path):
    """Token ids are ``[batch, seq]``: ids with an extra axis and ids with no token are refused before any work."""
    wrapped = moelens.wrap(small("mixtral"))
    path = tmp_path / "refused.nnef.tgz"
    refused = {
        r"takes token ids \[batch, seq\] \(integers\), but example_inputs is torch.int64 of shape \(1, 2, 6\)":
            torch.randint(3, 128, (1, 2, 6)),
        r"takes token ids \[batch, seq\].*of shape \(6,\)": torch.randint(3, 128, (6,)),
        r"example_inputs of shape \(1, 0\) hold no token": torch.zeros(1, 0, dtype=torch.long),
    }
    for message, ids in refused.items():
        with pytest.raises(ExportError, match=message):
            to_nnef(wrapped, path, example_inputs=ids)
        assert not path.exists()
    with pytest.raises(ExportError, match=r"example_inputs of shape \(1, 0, 32\) hold no token"):
        to_nnef(wrapped.moes[0], path, example_inputs=torch.zeros(1, 0, 32))


def test_an_all_ones_mask_of_another_shape_is_refused(tmp_path):
    """The mask must be all ones *in input_ids' shape*: ones of another shape (one row for two) are refused."""
    hf = small("mixtral")
    inputs = tiny_inputs(hf, batch=2, seq=6)
    path = tmp_path / "mask.nnef.tgz"
    for mask in (torch.ones(1, 6, dtype=torch.long), torch.ones(2, 5, dtype=torch.long)):
        with pytest.raises(ExportError, match=r"attention_mask \(shape \(\d, \d\)\) is not all ones in input_ids' "
                                              r"shape \(2, 6\)"):
            to_nnef(moelens.wrap(hf), path, example_inputs={**inputs, "attention_mask": mask})
        assert not path.exists()


# -- what is exported ------------------------------------------------------------------------------------


def test_edits_keyed_by_a_layer_that_two_blocks_share_are_refused():
    """Two MoE blocks with the same layer number (two stacks under one root): Edits keyed by that layer would
    edit both, so they are refused; the same blocks export unedited, each with its own weights."""
    from moelens.export.exporter import prepare
    from moelens.export.target import Block, Target
    from moelens.families import registry

    root = torch.nn.Module()
    root.first, root.second = tiny_model("mixtral", num_hidden_layers=1), tiny_model("mixtral", num_hidden_layers=1, seed=1)
    family = registry.get("mixtral")
    target = Target("model", root, [Block(f"{name}.model.layers.0.mlp", family, 0) for name in ("first", "second")])
    with pytest.raises(ExportRefused, match=r"layer 0 holds several MoE blocks \(first\.model\.layers\.0\.mlp, "
                                            r"second\.model\.layers\.0\.mlp\), so Edits keyed by layer are ambiguous: "
                                            r"export each block on its own with its edits, to_nnef\(model\.moes\[i\]"):
        prepare(target, edits=Edits(ablate={0: [1]}))
    assert len(prepare(target).reports) == 2


def test_a_block_of_a_model_that_carries_nnsight_edits_is_refused(tmp_path):
    """``model.edit()`` edits live on the wrapped model; exporting one of its blocks (``model.moes[i]``) would drop
    them as a whole-model export would, so both are refused until ``clear_edits``."""
    wrapped = moelens.wrap(small("mixtral"))
    with wrapped.edit(inplace=True):
        wrapped.moes[0].router_logits[..., 0] = 0.0
    path = tmp_path / "edited-block.nnef.tgz"
    for exported in (wrapped, wrapped.moes[0], wrapped.moes[1]):
        with pytest.raises(ExportRefused, match=r"carries 1 nnsight edit\(s\) \(model.edit\(\)\)"):
            to_nnef(exported, path, verify=False)
        assert not path.exists()
    wrapped.clear_edits()
    assert to_nnef(wrapped.moes[0], path, verify=False).path.is_file()


def test_a_model_sharded_over_one_rank_holds_every_expert_and_exports(tmp_path):
    """shard_experts over a world of one rank keeps all experts on that rank: nothing is missing, so the block
    exports (the refusal is for a rank holding only some experts)."""
    import torch.distributed as dist

    from moelens.parallel import shard_experts

    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        sharded = shard_experts(small("mixtral"), None)
        experts = sharded.model.layers[0].mlp.experts
        assert "_ep_group" in experts.__dict__ and experts._ep_num_local == experts.num_experts == 8
        report = to_nnef(moelens.wrap(sharded).moes[0], tmp_path / "one-rank.nnef.tgz", verify=False)
        assert report.path.is_file() and report.blocks[0].num_experts == 8
    finally:
        dist.destroy_process_group()



def test_a_model_configured_to_return_router_logits_exports_with_dynamic_tokens(tmp_path):
    """A config asking for the router logits (their auxiliary loss) and a KV cache: the exported copy turns both
    off (its blocks produce no router logits), also on the dynamic path whose forward passes no such keyword;
    the user's config keeps them."""
    from moelens.export import run

    hf = small("mixtral", output_router_logits=True, use_cache=True)
    report = to_nnef(moelens.wrap(hf), tmp_path / "router-logits.nnef.tgz", dynamic_tokens=True, verify=False)
    assert (hf.config.output_router_logits, hf.config.use_cache) == (True, True)
    ids = tiny_inputs(hf, batch=1, seq=5)["input_ids"]
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    torch.testing.assert_close(torch.from_numpy(run(report.path, ids)), expected, atol=1e-4, rtol=5e-4)

# -- the reference maths ----------------------------------------------------------------------------------


def test_clamped_swiglu_reference_matches_gpt_oss_where_the_clamp_bites():
    """gpt_oss clamps the gate from above only (``gate.clamp(max=limit)``) and the up projection both ways.

    Ground truth: the real transformers block. On inputs scaled so that many gate and up values lie beyond
    +-limit (7), tract's maths in torch (`MoeSpec.routed` in `ExportBlock`, what every export is checked
    against) equals it. With every gate pushed far below -limit (a gate bias of -30), the real experts
    output ~0 (silu of -30): a gate clamped from below too would give gate*sigmoid(1.702 gate) at -7 instead,
    ~ -5e-5 per neuron, a difference the large-input case alone cannot see at its scale.
    """
    from moelens.export.block import ExportBlock, TractMoeFfn, block_output, check_block
    from moelens.export.spec import read_spec
    from moelens.families import registry

    family = registry.get("gpt_oss")
    block = small("gpt_oss").model.layers[0].mlp.eval().cpu()  # the export's maths and check_block run on the CPU
    spec = read_spec(family, block, 0)
    assert spec.act_limit == 7.0
    x = 200.0 * torch.randn(2, 16, spec.wg.shape[1], generator=torch.Generator().manual_seed(0))
    gate = torch.einsum("...d,edh->...eh", x, spec.w1) + spec.w1_bias
    up = torch.einsum("...d,edh->...eh", x, spec.w3) + spec.w3_bias
    for values in (gate, up):  # the clamps bite, both ways
        assert (values < -7.0).float().mean() > 0.1 and (values > 7.0).float().mean() > 0.1
    with torch.no_grad():
        real = block_output(family, block(x)).float()
        mine = ExportBlock(family, block, TractMoeFfn(spec), root=True)(x)
    assert float(real.abs().max()) > 1.0
    assert float((real - mine).abs().max()) <= 1e-5 * float(real.abs().max())

    with torch.no_grad():
        block.experts.gate_up_proj_bias[:, ::2] = -30.0  # gpt_oss interleaves gate and up columns
        block.experts.down_proj_bias.zero_()
        block.experts.down_proj.mul_(1000.0)
    spec = read_spec(family, block, 0)
    assert bool((spec.w1_bias == -30.0).all())
    x = torch.randn(2, 16, spec.wg.shape[1], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        real = block_output(family, block(x)).float()
        mine = ExportBlock(family, block, TractMoeFfn(spec), root=True)(x)
    assert float(real.abs().max()) < 1e-8  # silu(-30) ~ 0: the experts output nothing
    assert float(mine.abs().max()) < 1e-8
    check_block(family, block, spec)


@pytest.mark.parametrize("multiplier", [1000.0, 0.1], ids=["outputs-of-a-few-units", "outputs-below-1e-3"])
def test_the_block_self_check_bound_is_1e_5_of_the_output_scale(multiplier):
    """check_block refuses a block whose output is off by 5e-5 of its scale (beyond its documented 1e-5 bound),
    and passes the same block off by 2e-6 (within it), whatever the scale: below 1 the bound was an absolute
    1e-5, so a block with outputs of 1e-4 passed a spec 2% off.

    Ground truth: the real block, its experts' output multiplied by hand; the error it causes is measured
    on check_block's own inputs."""
    from moelens.export.block import block_output, check_block
    from moelens.export.spec import read_spec
    from moelens.families import registry

    family = registry.get("mixtral")
    module = copy.deepcopy(small("mixtral").model.layers[0].mlp).float().eval().cpu()  # check_block runs on the CPU
    with torch.no_grad():
        module.experts.down_proj.mul_(multiplier)
    spec = read_spec(family, module, 0)
    x = torch.randn(2, 32, spec.wg.shape[1], generator=torch.Generator().manual_seed(0))  # check_block's inputs
    with torch.no_grad():
        scale = float(block_output(family, module(x)).abs().max())
    assert scale > 1.0 if multiplier > 1 else scale < 1e-3
    real = module.experts.forward
    for factor, refused in ((1 + 5e-5, True), (1 + 2e-6, False)):
        module.experts.forward = lambda *args, factor=factor, **kwargs: factor * real(*args, **kwargs)
        if refused:
            with pytest.raises(ExportRefused, match="refused rather than exported wrong"):
                check_block(family, module, spec)
        else:
            assert check_block(family, module, spec) <= 1e-5 * scale


def test_the_block_self_check_does_not_see_the_input_the_block_edited_in_place():
    """Mixtral's router jitter (train mode) multiplies the block's input in place: the block then computes on
    other inputs than tract's maths, and check_block must see the difference, not run both on the jittered x."""
    from moelens.export.block import check_block
    from moelens.export.spec import read_spec
    from moelens.families import registry

    family = registry.get("mixtral")
    module = copy.deepcopy(small("mixtral", router_jitter_noise=0.5).model.layers[0].mlp).float().cpu()  # check_block runs on the CPU
    spec = read_spec(family, module, 0)
    assert check_block(family, module.eval(), spec) <= 1e-5  # no jitter in eval mode
    with pytest.raises(ExportRefused, match="refused rather than exported wrong"):
        check_block(family, module.train(), spec)



def test_missing_expert_biases_are_written_as_zeros_of_their_own_shapes():
    """tract_moe_ffn binds its biases by position (wg_bias, w1_bias, w3_bias, w2_bias) after x, wg, w1, w2, w3: a
    spec with some expert biases fills the others with zeros of the shapes the spec documents (w1/w3 biases
    [E, H], w2_bias and the router's [E, D] / [E]), here with D != H so a swapped axis shows."""
    from moelens.export.extractor import op_inputs
    from moelens.export.spec import MoeSpec

    experts, d, h = 3, 4, 6
    spec = MoeSpec(family="hand", layer=0, k=2, gate="softmax_topk", scale=1.0, activation="swiglu", act_alpha=None,
                   act_limit=None, wg=torch.randn(experts, d), w1=torch.randn(experts, d, h),
                   w2=torch.randn(experts, h, d), w3=torch.randn(experts, d, h), w1_bias=torch.randn(experts, h))
    inputs = op_inputs(spec)
    assert [name for name, _ in inputs] == ["wg", "w1", "w2", "w3", "wg_bias", "w1_bias", "w3_bias", "w2_bias"]
    shapes = {name: tuple(tensor.shape) for name, tensor in inputs}
    assert shapes == {"wg": (3, 4), "w1": (3, 4, 6), "w2": (3, 6, 4), "w3": (3, 4, 6), "wg_bias": (3,),
                      "w1_bias": (3, 6), "w3_bias": (3, 6), "w2_bias": (3, 4)}
    assert inputs[5][1] is spec.w1_bias
    assert all(not tensor.any() for name, tensor in inputs if name in ("wg_bias", "w3_bias", "w2_bias"))
    # with no expert bias, the router's bias alone follows w3
    router_only = spec.with_weights(w1_bias=None, wg_bias=torch.ones(experts))
    assert [name for name, _ in op_inputs(router_only)] == ["wg", "w1", "w2", "w3", "wg_bias"]

# -- the archive writer -----------------------------------------------------------------------------------


def _export_folder(where: Path, tensors: list[str]) -> Path:
    """A folder as torch-to-nnef writes it: graph.nnef declaring ``tensors`` and one ``<label>.dat`` each."""
    where.mkdir(parents=True)
    body = "\n".join(f"    {name} = variable<scalar>(shape = [1], label = '{name}');" for name in tensors)
    (where / "graph.nnef").write_text(f"version 1.0;\ngraph g() -> ()\n{{\n{body}\n}}\n")
    for name in tensors:
        (where / f"{name}.dat").write_bytes(name.encode())
    return where


def test_a_folder_export_replaces_the_earlier_exports_tensors():
    """Writing over an earlier folder export leaves exactly the new export's files: the earlier tensors
    the new graph no longer names are gone (a stale .dat would make the folder two exports in one)."""
    with tempfile.TemporaryDirectory() as folder:
        base = Path(folder)
        target = base / "out"
        archive.write(_export_folder(base / "first", ["a", "b"]), target)
        assert sorted(p.name for p in target.iterdir()) == ["a.dat", "b.dat", "graph.nnef"]
        archive.write(_export_folder(base / "second", ["c"]), target)
        assert sorted(p.name for p in target.iterdir()) == ["c.dat", "graph.nnef"]
        assert (target / "c.dat").read_bytes() == b"c"


def test_a_folder_holding_only_what_a_killed_export_left_is_written_over():
    """A folder holding nothing but a staging copy a killed export left is an export folder: it is written into,
    and the leftover goes."""
    with tempfile.TemporaryDirectory() as folder:
        base = Path(folder)
        target = base / "out"
        killed = target / ".moelens-export-0123456789ab.part"
        killed.mkdir(parents=True)
        (killed / "graph.nnef").write_text("half\n")
        archive.check_destination(target)  # not refused as a folder of the user's
        archive.write(_export_folder(base / "new", ["a"]), target)
        assert sorted(p.name for p in target.iterdir()) == ["a.dat", "graph.nnef"]


@pytest.mark.parametrize("call, stop_at", [("unlink", 2), ("replace", 1), ("replace", 2)],
                         ids=["deleting-the-earlier", "moving-up-first", "moving-up-second"])
def test_a_folder_export_stopped_while_it_replaces_the_earlier_one_is_refused_as_incomplete(monkeypatch, call, stop_at):
    """Ctrl-C while the earlier export's files were deleted left its graph.nnef beside some of its tensors, read as a
    whole export (tract then failed on the missing tensors); while the new files were moved up, the next export was
    refused as "a folder with files of its own". Either is now an incomplete export to readers, and the next export
    writes over it."""
    with tempfile.TemporaryDirectory() as folder:
        base = Path(folder)
        target = base / "out"
        archive.write(_export_folder(base / "first", ["a", "b"]), target)
        original, calls = getattr(Path, call), []

        def stopped(self, *args, **kwargs):
            if self.parent == target or self.parent.parent == target:
                calls.append(self)
                if len(calls) == stop_at:
                    raise KeyboardInterrupt
            return original(self, *args, **kwargs)

        monkeypatch.setattr(Path, call, stopped)
        with pytest.raises(KeyboardInterrupt):
            archive.write(_export_folder(base / "second", ["c", "d"]), target)
        monkeypatch.setattr(Path, call, original)
        with pytest.raises(ExportError, match=r"out is an incomplete NNEF export: an export writing it was stopped"):
            archive.graph_text(target)
        archive.check_destination(target)  # not refused as a folder of the user's
        archive.write(_export_folder(base / "third", ["e"]), target)
        assert sorted(p.name for p in target.iterdir()) == ["e.dat", "graph.nnef"]
        assert "label = 'e'" in archive.graph_text(target)


def test_a_copy_that_fails_halfway_leaves_no_staging_folder(monkeypatch):
    """A folder export whose copy fails after some files (a full disk) removes its half-written staging copy
    and leaves the earlier export as it was."""
    with tempfile.TemporaryDirectory() as folder:
        base = Path(folder)
        target = base / "out"
        archive.write(_export_folder(base / "first", ["a"]), target)
        before = {p.name: p.read_bytes() for p in target.iterdir()}

        def half_copy(source, destination, *args, **kwargs):
            Path(destination).mkdir()
            (Path(destination) / "graph.nnef").write_text("half\n")
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(archive.shutil, "copytree", half_copy)
        with pytest.raises(ExportError, match=r"No space left on device\); what was there is left as it was"):
            archive.write(_export_folder(base / "second", ["b"]), target)
        assert {p.name: p.read_bytes() for p in target.iterdir()} == before


def test_an_archive_that_fails_to_write_leaves_no_temporary_file(monkeypatch):
    """An archive write that fails (a full disk) removes its temporary ``.<name>.<hex>.part`` file and keeps the
    earlier archive as it was."""
    with tempfile.TemporaryDirectory() as folder:
        base = Path(folder)
        path = base / "model.nnef.tgz"
        archive.write(_export_folder(base / "first", ["a"]), path)
        before = path.read_bytes()
        with tarfile.open(path) as tar:
            assert sorted(tar.getnames()) == ["a.dat", "graph.nnef"]

        class FullDisk(gzip.GzipFile):
            def write(self, data):
                raise OSError(28, "No space left on device")

        monkeypatch.setattr(archive.gzip, "GzipFile", FullDisk)
        with pytest.raises(ExportError, match=r"No space left on device\); what was there is left as it was"):
            archive.write(_export_folder(base / "second", ["b"]), path)
        assert path.read_bytes() == before
        assert sorted(p.name for p in base.iterdir()) == ["first", "model.nnef.tgz", "second"]


# -- verification -----------------------------------------------------------------------------------------


def test_a_verification_meets_its_own_level_and_every_looser_one():
    """``Verification.meets(level)``: the archive met ``level`` or a tighter one; a tolerance equal to the level
    meets it."""
    from moelens.export.runner import TOLERANCES
    from moelens.export.verification import Verification

    levels = list(TOLERANCES)
    for index, met in enumerate(levels):
        verification = Verification(0.0, met, "torch")
        assert [verification.meets(level) for level in levels] == [i >= index for i in range(len(levels))]
    assert not Verification(1.0, None, "torch").meets(levels[-1])


def test_a_bfloat16_model_is_verified_against_its_float32_copy(tmp_path):
    """The archive computes in float32 from a float32 copy of a bfloat16 model; to_nnef's check and `verify` run
    torch on a float32 copy too (the user's bfloat16 model is left as it is).

    Ground truth: the block's weights cast to float32 by hand, run in torch, against tract's output."""
    from moelens.export import run, verify

    hf = small("mixtral", dtype=torch.bfloat16)
    moe = moelens.wrap(hf).moes[0]
    hidden = torch.randn(1, 6, 32, generator=torch.Generator().manual_seed(0))
    report = to_nnef(moe, tmp_path / "bf16-block.nnef.tgz", example_inputs=hidden)
    assert report.verification.meets("approximate")
    with torch.no_grad():
        expected = copy.deepcopy(hf.model.layers[0].mlp).float()(hidden)
    torch.testing.assert_close(torch.from_numpy(run(report.path, hidden)), expected, atol=1e-4, rtol=5e-4)
    assert verify(report.path, moe, hidden).meets("approximate")
    assert {p.dtype for p in hf.parameters()} == {torch.bfloat16}


def test_dynamic_position_ids_count_from_zero_in_every_row():
    """The position ids a dynamic whole-model archive builds from input_ids are ``0 .. seq-1`` per row, as
    transformers numbers an unpadded prompt (rotary models hide a shift, absolute position embeddings do not)."""
    from moelens.export.masks import positions

    ids = torch.randint(3, 128, (3, 7), generator=torch.Generator().manual_seed(0))
    assert torch.equal(positions(ids), torch.arange(7).expand(3, 7))
    assert torch.equal(positions(ids[:, :1]), torch.zeros(3, 1, dtype=torch.long))


def test_family_support_takes_an_entry_or_its_name_and_refuses_anything_else():
    """A name is looked up in the registry (the entry's verdict), an unknown name or another object is a FamilyError."""
    from moelens.export import family_support
    from moelens.families import registry

    assert family_support("gpt_oss") == family_support(registry.get("gpt_oss"))
    assert family_support("zaya").status == "no" and family_support("mixtral").status == "yes"
    with pytest.raises(moelens.FamilyError, match=r"no moelens family named 'no_such_family'"):
        family_support("no_such_family")
    with pytest.raises(moelens.FamilyError, match=r"takes a family entry .* or its name, got int 3"):
        family_support(3)


def test_a_model_with_offloaded_weights_is_refused_up_front_naming_them(tmp_path):
    """accelerate's disk offload leaves weights on the meta device: an offloaded router or shared expert failed
    deep in the export (torch-to-nnef's NamedTensor error blaming attention, or a block-check mismatch of random
    size); the export refuses them up front, naming the weights, and writes nothing."""
    tiny_model("qwen2_moe").save_pretrained(tmp_path / "checkpoint")
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu",
                  "model.layers.0": "cpu", "model.layers.2": "cpu", "model.layers.3": "cpu", "model.layers.1.self_attn": "cpu", "model.layers.1.input_layernorm": "cpu",
                  "model.layers.1.post_attention_layernorm": "cpu", "model.layers.1.mlp.gate": "disk",
                  "model.layers.1.mlp.experts": "cpu", "model.layers.1.mlp.shared_expert": "cpu",
                  "model.layers.1.mlp.shared_expert_gate": "cpu"}
    model = moelens.load(tmp_path / "checkpoint", device_map=device_map, offload_folder=str(tmp_path / "offload"))
    assert model._module.model.layers[1].mlp.gate.weight.is_meta
    out = tmp_path / "out.nnef.tgz"
    assert model.moes[0].layer == 1  # layer 0 is dense
    for target, named in ((model.moes[0], r"the block to export has weights that are not loaded \(gate.weight on the "
                           r"meta device"), (model, r"the model to export .*\(model.layers.1.mlp.gate.weight on")):
        with pytest.raises(ExportError, match=named):
            to_nnef(target, out)
        assert not out.exists()
    to_nnef(model.moes[1], out)  # a block whose weights are all loaded exports


@pytest.mark.parametrize("text", ["my own notes, not moelens output\n", "graph g() -> ()\n{\n}\n",
                                  "version 1.0;\nnotes without a graph\n"])
def test_a_graph_nnef_that_is_no_nnef_document_is_the_users_not_an_export(text):
    """A folder or archive whose only file is named graph.nnef but holds no NNEF graph (a version line and a graph
    declaration) is the user's: refused, not replaced (any text passed when there were no tensors to match)."""
    with tempfile.TemporaryDirectory() as folder:
        base = Path(folder)
        (base / "mine").mkdir()
        (base / "mine" / "graph.nnef").write_text(text)
        with tarfile.open(base / "mine.nnef.tgz", "w:gz") as tar:
            tar.add(base / "mine" / "graph.nnef", arcname="graph.nnef")
        with pytest.raises(ExportError, match="mine' is a folder with files of its own"):
            archive.check_destination(base / "mine")
        with pytest.raises(ExportError, match="mine.nnef.tgz' is a file that is not an NNEF export"):
            archive.check_destination(base / "mine.nnef.tgz")
        archive.check_destination(_export_folder(base / "earlier", []))  # an export with no tensors is one


def test_the_export_copy_is_a_float32_cpu_copy_that_keeps_ties_and_leaves_the_model_alone():
    """The export traces a copy of the model on the CPU (tract runs there), each tensor copied straight to the CPU
    in float32: what ``copy.deepcopy(model).float().cpu()`` gives, ties kept, the model untouched."""
    from moelens.modules import cpu_float_copy

    hf = tiny_model("mixtral", dtype=torch.bfloat16, tie_word_embeddings=True)
    before = {name: tensor.clone() for name, tensor in hf.state_dict().items()}
    copied = cpu_float_copy(hf)
    expected = copy.deepcopy(hf).float().cpu()
    assert copied.lm_head.weight is copied.model.embed_tokens.weight
    assert copied.lm_head.weight is not hf.lm_head.weight
    for (name, tensor), (_, reference) in zip(copied.state_dict().items(), expected.state_dict().items(), strict=True):
        assert tensor.device.type == "cpu" and tensor.dtype == reference.dtype, name
        assert torch.equal(tensor, reference), name
    assert all(isinstance(p, torch.nn.Parameter) for p in copied.parameters())
    for name, tensor in hf.state_dict().items():
        assert tensor.dtype == before[name].dtype and torch.equal(tensor, before[name]), name
    inputs = tiny_inputs(hf)
    with torch.no_grad():
        torch.testing.assert_close(copied(**inputs).logits, expected(**inputs).logits, rtol=0, atol=0)


def test_router_bias_edits_of_ungated_experts_are_refused_not_bound_to_w3():
    """steer / route_around are baked as a router bias; with ungated experts (no w3) tract_moe_ffn would have read
    that bias in w3's place (read_spec refuses a model's own router bias there, bake made one after it)."""
    import dataclasses

    from moelens.export import Edits, ExportRefused
    from moelens.export.spec import read_spec
    from moelens.testing import tiny_model

    hf = tiny_model("mixtral")
    wrapped = moelens.wrap(hf)
    moe = wrapped.moes[1]
    spec = read_spec(moe.family, moe._module, moe.layer)
    ungated = dataclasses.replace(spec.clone(), w3=None)
    for edits in (Edits(steer={1: {2: 1.0}}), Edits(route_around={1: [2]})):
        with pytest.raises(ExportRefused, match=r"Edits at layer 1: steer and route_around are baked as a router bias, "
                                                r"which ungated experts cannot take"):
            edits.bake(ungated)
    baked = Edits(ablate={1: [2]}).bake(ungated)  # the experts' weights: no bias needed
    assert baked.wg_bias is None and float(baked.w2[2].abs().max()) == 0.0


def test_a_whole_model_with_one_moe_layer_is_not_called_a_block_exported_on_its_own(tmp_path):
    """Edits of a layer without an MoE block were refused with "(a block exported on its own takes edits of its layer
    only)" whenever the target had one MoE layer: so for a whole model with a single MoE layer too, in the export and
    in Edits.intervene. The note is now given for a block export (model.moes[i]) only."""
    hf = small("qwen3_moe")  # 2 decoder layers: layer 0 dense, layer 1 MoE
    wrapped = moelens.wrap(hf)
    moe_layers = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]  # from the modules
    assert [moe.layer for moe in wrapped.moes] == moe_layers == [1]
    edits = Edits(ablate={0: [1]})
    plain = r"^Edits.ablate\[0\] names a layer with no MoE block here; the MoE layers are \[1\]\.$"
    with pytest.raises(ExportError, match=plain):
        to_nnef(wrapped, tmp_path / "model.nnef.tgz", edits=edits, verify=False)
    with pytest.raises(ExportError, match=plain):
        with wrapped.trace(tiny_inputs(hf, batch=1, seq=4)["input_ids"]):
            edits.intervene(wrapped)
    with pytest.raises(ExportError, match=r"the MoE layers are \[1\] \(a block exported on its own takes edits of "
                                          r"its layer only\)\.$"):
        to_nnef(wrapped.moes[0], tmp_path / "block.nnef.tgz", edits=edits, verify=False)
