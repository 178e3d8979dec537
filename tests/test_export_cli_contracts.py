"""Contracts of the export's command-line parts that the wider export tests leave unpinned.

The tract stand-in (`moelens.export.tract_cli`: tolerance rule, options, exit statuses), the runner's
version gate and error reporting, the family table's rendering and writing, and the ``moelens export``
command's wiring of its options into `to_nnef`. Ground truths are hand-computed numbers from tract's
documented rule (``|a - b| <= atol + rtol * |b|``, all but an outlier fraction), fakes whose outputs the
test sets (a runnable, a child process, an exporter that records what it was asked), and the command's
own arguments. Nothing here traces or runs tract, so each test takes well under a second (the command's
tests load moelens-tiny once, in about a second). Needs the ``export`` extra.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("torch_to_nnef", reason="the export extra is not installed (pip install 'moelens[export]')")
pytest.importorskip("tract", reason="the export extra is not installed (pip install 'moelens[export]')")

from moelens.export import ExportError  # noqa: E402
from moelens.export import runner, table, tract_cli  # noqa: E402
from moelens.export.tract_cli import meets  # noqa: E402

INF, NAN = np.inf, np.nan


# -- tract's tolerance rule -------------------------------------------------------------------------------


def test_relative_tolerance_scales_with_the_expected_value_not_the_actual():
    """``|a - b| <= atol + rtol * |b|`` with ``b`` the expected side. At 'ultra' (0.2, 0.1): a=0, b=0.22 is
    within 0.2 + 0.022 = 0.222; a=0.22, b=0 is not (0.22 > 0.2 + 0)."""
    assert meets(np.array([0.0]), np.array([0.22]), "ultra")
    assert not meets(np.array([0.22]), np.array([0.0]), "ultra")
    # 'very' (0.05, 0.01): 0.0505 <= 0.05 + 0.000505, but not against 0.05 + 0.
    assert meets(np.array([0.0]), np.array([0.0505]), "very")
    assert not meets(np.array([0.0505]), np.array([0.0]), "very")


def test_outputs_of_another_shape_never_meet_a_level_even_when_they_broadcast():
    zeros = np.zeros(4, dtype=np.float32)
    assert meets(zeros, zeros, "exact")
    assert not meets(zeros[None], zeros, "ultra")  # (1, 4) against (4,): numpy would broadcast them
    assert not meets(np.zeros((4, 1)), zeros, "ultra")


def test_infinities_meet_only_an_infinity_of_the_same_sign_and_nan_only_nan():
    """At 'exact' (no tolerance) an infinity meets only the same infinity, NaN only NaN. (At a level with a
    relative tolerance, ``|a - b| = inf <= atol + rtol * inf`` holds for any ``a`` against an infinite ``b``.)"""
    assert meets(np.array([INF, -INF, NAN]), np.array([INF, -INF, NAN]), "exact")
    for actual, expected in ((INF, -INF), (-INF, INF), (1.0, INF), (INF, 1.0), (NAN, 1.0), (1.0, NAN), (INF, NAN)):
        assert not meets(np.array([actual]), np.array([expected]), "exact"), (actual, expected)
    for actual, expected in ((NAN, 1.0), (1.0, NAN), (INF, NAN), (NAN, INF), (INF, 1e30)):
        assert not meets(np.array([actual]), np.array([expected]), "ultra"), (actual, expected)


def test_an_empty_output_meets_every_level():
    empty = np.zeros((1, 0, 3), dtype=np.float32)
    assert all(meets(empty, empty, level) for level in tract_cli.TOLERANCES)


def test_outlier_fractions_are_counted_per_value():
    """'super' lets 1e-4 of the values be off, 'very' none: 1 far-off value in 10 000 meets 'super', 2 do not."""
    expected = np.zeros(10_000, dtype=np.float32)
    one, two = expected.copy(), expected.copy()
    one[0] = two[:2] = 10.0
    assert meets(one, expected, "super") and meets(one, expected, "ultra")
    assert not meets(one, expected, "very")
    assert not meets(two, expected, "super") and meets(two, expected, "ultra")  # ultra: 5e-4 = 5 values


def test_tolerance_met_is_the_tightest_level_by_hand():
    """Against b = 1 the levels allow |a - b| of: exact 0, close 2e-7, approximate 6e-4, very 0.06, super 0.15,
    ultra 0.3 (atol + rtol)."""
    one = np.ones(3, dtype=np.float32)
    for error, level in ((0.0, "exact"), (3e-4, "approximate"), (0.03, "very"), (0.1, "super"), (0.25, "ultra"),
                         (0.5, None)):
        assert runner.tolerance_met(one + np.float32(error), one) == level, error


def test_an_infinity_torch_computes_must_be_tracts_too():
    """tract's rule |a - b| <= atol + rtol |b| holds for any a against b = inf (inf <= inf): the stand-in keeps
    tract's rule, verification's level does not let 5.0 or -inf pass for torch's +inf."""
    from moelens.export.tract_cli import meets

    expected = np.array([1.0, np.inf], dtype=np.float32)
    for actual in ([1.0, 5.0], [1.0, -np.inf]):
        actual = np.array(actual, dtype=np.float32)
        assert meets(actual, expected, "close")  # tract's own comparison
        assert runner.tolerance_met(actual, expected) is None
    assert runner.tolerance_met(expected.copy(), expected) == "exact"
    assert runner.tolerance_met(np.array([1.0, np.inf], dtype=np.float32), np.array([1.0, 5.0], dtype=np.float32)) is None


# -- the tract stand-in's command line -----------------------------------------------------------------------


class FakeOutput:
    def __init__(self, value):
        self.value = value

    def to_numpy(self):
        return self.value


class FakeRunnable:
    """A loaded archive that doubles its first input and records what it ran on."""

    def __init__(self, count=1):
        self.count, self.seen = count, []

    def run(self, arrays):
        self.seen.append(arrays)
        return [FakeOutput(arrays[0] * 2 + i) for i in range(self.count)]


@pytest.fixture
def standin(monkeypatch, tmp_path):
    """tract_cli.main with a fake archive of inputs ``a`` and ``b`` (output: 2 * a), and a bundle of inputs."""
    runnable = FakeRunnable()
    monkeypatch.setattr(tract_cli, "load_runnable", lambda path: (runnable, ["a", "b"]))
    a = np.arange(6, dtype=np.float32).reshape(1, 6)
    b = -np.ones((1, 2), dtype=np.float32)
    np.savez(tmp_path / "in.npz", b=b, a=a)  # saved in the other order than the archive's inputs

    def call(*argv, expected=None):
        command = ["model.nnef.tgz", "-O", "run", "--input-from-bundle", str(tmp_path / "in.npz"), *argv]
        if expected is not None:
            np.savez(tmp_path / "out.npz", **expected)
            command += ["--assert-output-bundle", str(tmp_path / "out.npz")]
        return tract_cli.main(command)

    return SimpleNamespace(call=call, runnable=runnable, a=a, b=b, folder=tmp_path)


def test_standin_feeds_the_bundles_inputs_by_name(standin):
    assert standin.call() == 0
    fed = standin.runnable.seen[0]
    assert np.array_equal(fed[0], standin.a) and np.array_equal(fed[1], standin.b)


def test_standin_compares_at_close_unless_told_otherwise(standin, capsys):
    """tract's ``--approx`` defaults to 'close' (1e-7, 1e-7): an output off by 1e-5 fails it, passes 'approximate'."""
    off = {"output": standin.a * 2 + np.float32(1e-5)}
    assert standin.call(expected=off) == 1
    assert "ERROR output output" in capsys.readouterr().err
    assert standin.call("--approx", "approximate", expected=off) == 0
    assert "ERROR" not in capsys.readouterr().err
    assert standin.call("--approx", "close", expected={"output": standin.a * 2}) == 0


def test_standin_exit_statuses(standin, capsys):
    """1 and an ERROR line for an output that fails its level, 2 for a level tract does not know, 1 for more
    expected outputs than the model has, 2 for a command line that names no model first."""
    assert standin.call("--approx", "very", expected={"output": standin.a * 2 + 1}) == 1
    assert "exceeds tract's 'very' tolerance" in capsys.readouterr().err
    assert standin.call("--approx", "roughly", expected={"output": standin.a * 2}) == 2
    assert "unknown --approx level 'roughly'" in capsys.readouterr().err
    assert standin.call(expected={"first": standin.a * 2, "second": standin.a}) == 1
    assert "ERROR output second: the model has only 1 outputs" in capsys.readouterr().err
    assert tract_cli.main(["--input-from-bundle", str(standin.folder / "in.npz"), "run"]) == 2
    assert "only `--version` and `MODEL ... run" in capsys.readouterr().err
    assert len(standin.runnable.seen) == 3  # the refused command line ran nothing


def test_standin_saves_its_outputs(standin):
    standin.runnable.count = 2
    saved = standin.folder / "saved.npz"
    assert standin.call("--save-outputs-npz", str(saved)) == 0
    with np.load(saved) as outputs:
        assert outputs.files == ["output_0", "output_1"]
        assert np.array_equal(outputs["output_0"], standin.a * 2)
        assert np.array_equal(outputs["output_1"], standin.a * 2 + 1)


def test_one_line_joins_tracts_causes_and_drops_the_backtrace():
    error = RuntimeError("opening file x.nnef\n\nCaused by:\n    0: running pass PropConst\n    1: Abs does not "
                         "support TDim\n\nStack backtrace:\n   0: tract_core::model::foo\n   1: main")
    assert tract_cli.one_line(error) == ("opening file x.nnef; caused by: 0: running pass PropConst; "
                                         "1: Abs does not support TDim")


# -- the runner ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version, refused", [("0.23.8", True), ("0.22.99", True), ("0.23.9", False),
                                              ("0.23.10", False), ("0.24.0", False), ("1.0.0", False)])
def test_tract_older_than_the_first_with_tract_moe_ffn_is_refused(monkeypatch, version, refused):
    import tract

    assert runner.MIN_TRACT_VERSION == "0.23.9"
    monkeypatch.setattr(tract, "version", lambda: version)
    if refused:
        with pytest.raises(ExportError, match=rf"tract {version} has no tract_moe_ffn; install tract>=0.23.9"):
            runner.tract_module()
    else:
        assert runner.tract_module() is tract


def test_loaded_run_by_name_orders_the_inputs_and_names_a_missing_one():
    runnable = FakeRunnable()
    loaded = runner.Loaded(runnable, ["a", "b"], {})
    a, b = np.ones((1, 2), np.float32), np.zeros((1, 3), np.float32)
    assert np.array_equal(loaded.run({"b": b, "a": a})[0], a * 2)
    assert runnable.seen[0][0] is not b and np.array_equal(runnable.seen[0][1], b)
    with pytest.raises(ExportError, match=r"the archive's inputs are \['a', 'b'\]; missing \['b'\]"):
        loaded.run({"a": a})


def test_run_isolated_names_tracts_panic_line(monkeypatch, tmp_path):
    """A Rust panic in the child: the error's detail is tract's 'panicked at' line, not its last stderr line."""
    archive = tmp_path / "model.nnef.tgz"
    archive.write_bytes(b"")
    panic = ("thread 'main' panicked at src/ops/matmul.rs:12:5:\nindex out of bounds: the len is 2 but the index is 3\n"
             "note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace\n")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 134, "", panic))
    message = r"\(exit status 134\): thread 'main' panicked at src/ops/matmul.rs"
    with pytest.raises(ExportError, match=message) as caught:
        runner.run_isolated(archive, [np.zeros((1, 2), np.float32)])
    assert caught.value.detail == "thread 'main' panicked at src/ops/matmul.rs:12:5:"
    quiet = "some warning\nlast words\n"
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", quiet))
    with pytest.raises(ExportError) as caught:
        runner.run_isolated(archive, [np.zeros((1, 2), np.float32)])
    assert caught.value.detail == "last words"


# -- the family table -------------------------------------------------------------------------------------------


def test_experts_and_shared_cells_by_hand():
    spec = SimpleNamespace(activation_label="silu", has_expert_biases=True, wg_bias=np.zeros(4), scale=0.5)
    assert table._experts(spec) == "silu, biases, router bias, x 0.5"
    plain = SimpleNamespace(activation_label="gelu_tanh", has_expert_biases=False, wg_bias=None, scale=1.0)
    assert table._experts(plain) == "gelu_tanh"
    shared = SimpleNamespace
    assert table._shared(shared(shared=None)) == "–"
    assert table._shared(shared(shared=shared(on_layer=True, gate=None))) == "on the layer (traced)"
    assert table._shared(shared(shared=shared(on_layer=False, gate="shared_expert_gate"))) == "sigmoid-gated subgraph"
    assert table._shared(shared(shared=shared(on_layer=False, gate=None))) == "subgraph"


def test_rows_follow_the_entry_and_the_tiny_block(monkeypatch):
    """An entry's 'if' stays 'if' when its tiny block is refused (the note says so); a 'yes' whose tiny block is
    refused becomes 'no'; a 'no' is never built."""
    supports = {
        "cond": SimpleNamespace(status="if", gate="softmax", condition="x is y", reason=""),
        "yes-refused": SimpleNamespace(status="yes", gate="sigmoid", condition="", reason=""),
        "yes": SimpleNamespace(status="yes", gate="softmax", condition="", reason=""),
        "no": SimpleNamespace(status="no", gate="–", condition="", reason="tract has no such gate"),
    }
    checks = {"cond": ("", "the block is odd"), "yes-refused": ("", "bad scale"), "yes": ("silu", "")}
    checked = []
    monkeypatch.setattr(table, "family_support", lambda family: supports[family.name])
    monkeypatch.setattr(table, "_tiny_check", lambda family: checked.append(family.name) or checks[family.name])
    families = [SimpleNamespace(name=name, shared=None) for name in supports]
    found = {row.family: row for row in table.rows(families)}
    assert checked == ["cond", "yes-refused", "yes"]
    assert (found["cond"].exports, found["cond"].note) == (
        "if", "exports when x is y. The tiny model's block is refused: the block is odd")
    assert (found["yes-refused"].exports, found["yes-refused"].note) == ("no", "the tiny model's block: bad scale")
    assert (found["yes"].exports, found["yes"].experts, found["yes"].note) == ("yes", "silu", "")
    assert (found["no"].exports, found["no"].note) == ("no", "tract has no such gate")


def test_render_escapes_a_pipe_in_a_note():
    row = table.Row("fam", "no", "–", "–", "–", "a | b")
    assert table.render([row]).splitlines()[-1] == "| fam | **no** | – | – | – | a \\| b |"


def test_replace_table_keeps_the_text_around_the_markers_and_needs_both():
    text = f"intro\n{table.START}\nold table\n{table.END}\noutro\n"
    assert table.replace_table(text, "NEW\n") == f"intro\n{table.START}\nNEW\n{table.END}\noutro\n"
    for broken in (text.replace(table.END, ""), text.replace(table.START, "")):
        with pytest.raises(ValueError, match="markers"):
            table.replace_table(broken, "NEW\n")


def test_table_write_replaces_the_table_in_the_doc(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(table, "support_table", lambda families=None: "| the | table |\n")
    doc = tmp_path / "export.md"
    doc.write_text(f"# Export\n{table.START}\nstale\n{table.END}\nafter\n")
    assert table.main(["--write", str(doc)]) == 0
    assert doc.read_text() == f"# Export\n{table.START}\n| the | table |\n{table.END}\nafter\n"
    assert capsys.readouterr().out == ""
    assert table.main([]) == 0 and capsys.readouterr().out == "| the | table |\n"


# -- the moelens export command -----------------------------------------------------------------------------------


def parsed(*argv):
    from moelens.cli import build_parser

    return build_parser().parse_args(["export", "tiny", "x.nnef.tgz", *argv])


def test_edit_options_accumulate_per_layer_and_keep_their_kinds():
    from moelens.export.cli import parse_edits

    edits = parse_edits(parsed("--ablate", "1:3", "--ablate", "1:5,6", "--route-around", "2:0", "--steer", "1:2=0.5",
                               "--steer", "1:4=-1", "--swap", "3:1=2"))
    assert edits.ablate == {1: (3, 5, 6)}
    assert edits.route_around == {2: (0,)}
    assert edits.steer == {1: {2: 0.5, 4: -1.0}}
    assert edits.swap == {3: {1: 2}}


@pytest.mark.parametrize("argv, message", [
    (["--ablate", "3:0,0"], "--ablate '3:0,0': expert 0 of layer 3 is given twice; give each expert of a layer once."),
    (["--ablate", "3:1", "--ablate", "3:2,1"], "--ablate '3:2,1': expert 1 of layer 3 is given twice"),
    (["--route-around", "2:5,4,5"], "--route-around '2:5,4,5': expert 5 of layer 2 is given twice"),
    # a layer that passed the digit check but not int() ended in a traceback (exit 1)
    (["--ablate=--1:2"], "--ablate '--1:2': expected LAYER:..., e.g. --ablate 1:3"),
    (["--route-around=\u00b2:2"], "--route-around '\u00b2:2': expected LAYER:..., e.g. --route-around 1:3"),
])
def test_an_expert_given_twice_to_ablate_is_refused_as_for_steer_and_swap(tmp_path, capsys, argv, message):
    """`--ablate 3:0,0` exported with `ablate [0, 0]` in its summary and archive, where --steer / --swap refuse
    an expert given twice; refused in one line, before the model loads (nothing is written)."""
    from moelens.cli import main

    out = tmp_path / "x.nnef.tgz"
    status = main(["export", "tiny", str(out), "--no-verify", "--tokens", "2", *argv])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and err.startswith(f"moelens export: error: {message}"), err
    assert not out.exists()


def test_an_edit_of_a_layer_block_does_not_export_is_refused_by_its_option(monkeypatch, tmp_path, capsys):
    """`--block 1 --ablate 2:3` on moelens-tiny (MoE layers 0-3) said layer 2 holds no MoE block; refused before
    the model loads, naming the option and the layer --block exports."""
    import moelens.export.cli as export_cli
    from moelens.cli import main

    monkeypatch.setattr(export_cli, "load_checkpoint", lambda source: pytest.fail("the model was loaded"))
    out = tmp_path / "x.nnef.tgz"
    status = main(["export", "tiny", str(out), "--block", "1", "--ablate", "2:3", "--steer", "1:2=1", "--swap", "3:1=0"])
    err = capsys.readouterr().err
    assert status == 2 and err == (
        "moelens export: error: --ablate of layer 2, --swap of layer 3: --block 1 exports layer 1's MoE block alone, so it "
        "takes edits of layer 1 only; edit that layer, or export the whole model (without --block).\n")
    assert not out.exists()


@pytest.mark.parametrize("argv, message", [
    (["export", "tiny", "x.nnef.tgz", "--steer", "1:3=inf"],
     "--steer of layer 1: the biases of experts [3] are not finite ([inf]); give finite biases (a few tens already "
     "decide the routing), or use --route-around to remove an expert."),
    (["export", "tiny", "x.nnef.tgz", "--ablate", "1:99"], "--ablate of layer 1: experts [99] out of range: layer 1's "
     "MoE block has 8 experts; give expert ids 0..7."),
    (["export", "tiny", "x.nnef.tgz", "--ablate", "1:3", "--swap", "1:3=4"], "--ablate of layer 1 and --swap of layer 1 "
     "both name experts [3]: an expert's slots are either zeroed or run another expert; pick one."),
    # a swap to itself: the advice said "Edits.ablate", which the command's user cannot type
    (["export", "tiny", "x.nnef.tgz", "--swap", "1:3=3"], "--swap of layer 1: experts [3] are swapped to themselves, so "
     "nothing would change; give another expert to take over their slots (or zero-ablate them: --ablate of layer 1)."),
    (["export", "tiny", "x.nnef.tgz", "--ablate", "99:1", "--route-around", "7:2"], "--route-around of layer 7, "
     "--ablate of layer 99 name layers with no MoE block here; the MoE layers are [0, 1, 2, 3]."),  # was "Edits name"
    (["export", "tiny", "x.nnef.tgz", "--tokens", "300"], "--tokens 300: 300 tokens is longer than the model's "
     "context (max_position_embeddings=256); export at a length of at most 256 (an archive with --dynamic-tokens"),
    (["stats", "tiny", "--text", "notes.txt", "--max-length", "9999"],
     "--max-length 9999 is longer than the model's context (max_position_embeddings=256)"),
])
def test_errors_of_the_python_api_name_the_commands_options(monkeypatch, tmp_path, capsys, argv, message):
    """The API's errors named its settings (`Edits.steer[1]`, `use route_around`, `tokens=300`,
    `dynamic_tokens=True`, `max_length=9999`), which a user of the command cannot type."""
    from moelens.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("Experts route tokens.\n")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moelens {argv[0]}: error: {message}"), err
    assert "max_length" not in err and "route_around" not in err and "Edits." not in err


def test_only_the_commands_options_are_respelled():
    from moelens.cli import spelled_as_options

    options = {"max_length": "--max-length", "dynamic_tokens": "--dynamic-tokens", "tokens": "--tokens",
               "steer": "--steer"}
    assert spelled_as_options("tokens=3 tokens, max_length=4 max_length; dynamic_tokens=True dynamic_tokens",
                              options) == "--tokens 3 tokens, --max-length 4 --max-length; --dynamic-tokens --dynamic-tokens"
    kept = "Edits(steer={1: {3: 30.0}}), batch_size=2, max_position_embeddings=256, Edits.swap[1], x.max_length"
    assert spelled_as_options(kept, options) == kept
    # paths, file names, quoted text and the arguments of a call the message quotes stay as they are
    code = ("text file 'max_length/notes.txt', './max_length', 'max_length', max_length.txt, 'my max_length text', "
            "ablate(moe, e, \"route_around\"), to_nnef(model, path, dynamic_tokens=True), Edits(ablate={1: [2]}, steer={})")
    assert spelled_as_options(code, options | {"route_around": "--route-around", "ablate": "--ablate"}) == code
    assert spelled_as_options("(an archive with dynamic_tokens=True takes any length); use max_length.",
                              options) == "(an archive with --dynamic-tokens takes any length); use --max-length."


def test_a_path_named_like_an_option_is_quoted_as_given(tmp_path, capsys):
    """`--text max_length/notes.txt` was reported as '--max-length/notes.txt' (the respelling took it for a setting)."""
    from moelens.cli import main

    assert main(["stats", "tiny", "--text", str(tmp_path / "max_length" / "notes.txt")]) == 2
    assert f"'{tmp_path}/max_length/notes.txt' does not exist" in capsys.readouterr().err
    (tmp_path / "route_around").mkdir()
    (tmp_path / "route_around" / "mine.txt").write_text("mine\n")
    assert main(["export", "tiny", str(tmp_path / "route_around")]) == 2  # refused before the model loads
    assert f"'{tmp_path}/route_around' is a folder with files of its own" in capsys.readouterr().err


@pytest.fixture
def recorded(monkeypatch):
    """``moelens export`` with to_nnef replaced by a recorder (nothing traced) that returns a verified report."""
    from moelens.export import exporter
    from moelens.export.exporter import BlockReport, ExportReport
    from moelens.export.verification import Verification

    calls = []

    def to_nnef(target, path, **options):
        calls.append(SimpleNamespace(target=target, path=path, options=options))
        q4_0 = {"export_max_abs_error": 4e-7, "export_tolerance": "close"}  # the archive's own weights in torch
        check = Verification(2e-6, "approximate", "torch", {**q4_0, "second_length": {
            "tokens": 9, "max_abs_error": 3e-6, "tolerance": None, **q4_0, "export_max_abs_error": 5e-7}})
        block = BlockReport(layer=0, family="mixtral", gate="softmax_topk", activation="silu", k=2, num_experts=8,
                            edits="ablate [1]")
        return ExportReport(path=Path(path), kind="block", blocks=[block], input_name="hidden_states",
                            output_name="mlp_output", bytes=2_000_000, seconds=1.0, verification=check)

    monkeypatch.setattr(exporter, "to_nnef", to_nnef)
    return calls


def test_export_passes_its_options_to_to_nnef(recorded, tmp_path, capsys):
    from moelens.cli import main

    out = tmp_path / "block.nnef.tgz"
    status = main(["export", "tiny", str(out), "--block", "0", "--tokens", "3", "--no-verify", "--dynamic-tokens",
                   "--quantize-experts", "q4_0", "--layout", "linear", "--ablate", "0:1"])
    printed = capsys.readouterr().out
    assert status == 0, printed
    (call,) = recorded
    assert call.path == str(out) and call.target.layer == 0 and type(call.target).__name__ == "Moe"
    inputs = call.options["example_inputs"]
    assert inputs.shape[:2] == (1, 3) and inputs.ndim == 3 and inputs.is_floating_point()  # hidden states
    assert call.options["verify"] is False and call.options["dynamic_tokens"] is True
    assert call.options["quantize_experts"] == "q4_0" and call.options["layout"] == "linear"
    assert call.options["edits"].ablate == {0: (1,)}
    assert "layer 0: mixtral -> tract_moe_ffn(E=8, k=2, gate=softmax_topk, activation=silu); ablate [1]" in printed
    # "ultra" read as the best level: each level is ranked among tract's six, tightest first
    assert ("max abs error 2e-06 on outputs up to 1 (tract tolerance: approximate, 3 of 6 from the tightest); vs the "
            "archive's Q4_0 weights in torch: 4e-07 (close, 2 of 6 from the tightest); at 9 tokens: 3e-06 (none met); "
            "vs the archive's Q4_0 weights in torch: 5e-07 (close, 2 of 6 from the tightest)") in printed
    recorded.clear()
    assert main(["export", "tiny", str(out), "--tokens", "5"]) == 0  # the defaults: the whole model, verified
    (call,) = recorded
    assert tuple(call.options["example_inputs"].shape) == (1, 5)  # token ids: the whole model
    assert not call.options["example_inputs"].is_floating_point() and type(call.target).__name__ != "Moe"
    assert call.options["verify"] is True and call.options["dynamic_tokens"] is False
    assert call.options["quantize_experts"] is None and call.options["layout"] == "canonical"


def test_export_refuses_a_bad_out_before_loading_the_model(monkeypatch, tmp_path, capsys):
    import moelens.export.cli as export_cli
    from moelens.cli import main

    def never(source):
        raise AssertionError("the model was loaded for an OUT that is refused")

    monkeypatch.setattr(export_cli, "load_checkpoint", never)
    (tmp_path / "file.txt").write_text("mine\n")
    assert main(["export", "tiny", str(tmp_path / "file.txt" / "x.nnef.tgz")]) == 2
    assert "which is a file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # a usage error: argparse's line after the usage
        main(["export", "tiny"])
    assert exit_info.value.code == 2 and "error: the following arguments are required: OUT" in capsys.readouterr().err
    # An archive name with a trailing slash: to_nnef refuses it as unclear, and argparse's Path dropped the slash
    # (an archive was written). Refused here too, as OUT, with nothing written.
    assert main(["export", "tiny", f"{tmp_path}/x.nnef.tgz/", "--block", "1"]) == 2
    assert "OUT " in (err := capsys.readouterr().err) and "ends like an archive and with a slash" in err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["file.txt"]


def test_an_option_between_model_and_out_is_read_as_anywhere_else(recorded, tmp_path, capsys):
    """`moelens export tiny --block 2 x.nnef.tgz` failed with "unrecognized arguments: x.nnef.tgz" (MODEL and OUT were
    both optional, so argparse gave 'tiny' alone to the pair)."""
    from moelens.cli import build_parser, main

    out = str(tmp_path / "block.nnef.tgz")
    first = build_parser().parse_args(["export", "--block", "2", "--tokens", "3", "tiny", out])
    for argv in (["tiny", "--block", "2", out, "--tokens", "3"], ["tiny", out, "--block", "2", "--tokens", "3"],
                 ["--tokens", "3", "tiny", "--block", "2", out]):
        assert vars(build_parser().parse_args(["export", *argv])) == vars(first), argv
    assert main(["export", "tiny", "--block", "2", out, "--no-verify"]) == 0, capsys.readouterr().err
    (call,) = recorded
    assert call.path == out and call.target.layer == 2


@pytest.mark.parametrize("argv", [["export", "--support"], ["export", "tiny", "--support"]])
def test_support_prints_the_table_without_model_and_out(argv, capsys):
    from moelens.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    printed = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert printed == table.support_table() and "| mixtral | **yes**" in printed


def test_block_refuses_a_layer_with_several_moe_blocks_naming_them(tmp_path, capsys):
    """`--block 1` on ernie4_5_vl_moe (text_moe and vision_moe in layer 1) silently took the first of the two; it
    names both, before the export's own refusal of the family (its blocks' output is no FFN output)."""
    from moelens.cli import main
    from moelens.testing import tiny_model

    hf = tiny_model("ernie4_5_vl_moe")
    hf.save_pretrained(tmp_path / "ernie")
    capsys.readouterr()  # transformers' progress bar, where no command has turned them off before (run alone)
    both = ["layers.1.mlp.text_moe", "layers.1.mlp.vision_moe"]
    assert set(both) <= {name for name, _ in hf.named_modules()}  # the model's own two blocks of layer 1
    out = tmp_path / "block.nnef.tgz"
    assert main(["export", str(tmp_path / "ernie"), "--block", "1", str(out), "--no-verify"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moelens export: error: --block 1: layer 1 holds 2 MoE blocks (") and err.count("\n") == 1
    named = re.findall(r"model\.moes\[\d+\] is ([\w.]+)", err)  # as loaded: under the causal LM's .model
    assert len(named) == 2 and all(path.endswith(name) for path, name in zip(named, both)), err
    assert "not an FFN output" not in err
    assert not out.exists()


# -- the export's refusal of hooks --------------------------------------------------------------------------------


def test_moelens_own_hooks_are_not_foreign_and_a_users_are():
    """moelens registers a `_GatheredNote` (wrapping ernie4_5_vl_moe) and shard_experts' guard and run counting
    (partials; compress's calibration recorders are functions of moelens too); none may count as a user's, every
    user's hook still does."""
    import functools

    import torch

    from moelens.components.gathered import _GatheredNote
    from moelens.modules import foreign_hooks
    from moelens.parallel import runs, shard

    module = torch.nn.Linear(2, 2)
    module.register_forward_pre_hook(_GatheredNote(), with_kwargs=True)
    module.register_forward_pre_hook(shard._guard)
    module.register_forward_pre_hook(functools.partial(runs.forward_enters, None))
    module.register_forward_hook(functools.partial(runs.forward_leaves, None))
    assert foreign_hooks(module) == []

    def mine(module, args, output):
        return output

    class Yours:
        def __call__(self, module, args):
            return None

    theirs = Yours()
    module.register_forward_hook(mine)
    module.register_forward_pre_hook(theirs)
    wrapped_user = functools.partial(mine)
    module.register_forward_hook(wrapped_user)
    assert foreign_hooks(module) == [mine, wrapped_user, theirs]


def test_a_wrapped_ernie_is_refused_for_what_it_is_not_for_moelens_own_hook(tmp_path):
    """Wrapped, ernie4_5_vl_moe was refused for "a forward hook (a _GatheredNote) ... Remove it", a hook moelens put
    there; the reason is the one to_nnef gives the unwrapped model. A user's hook on a block is still refused."""
    import moelens
    from moelens.export import ExportRefused, to_nnef
    from moelens.testing import tiny_model

    hf = tiny_model("ernie4_5_vl_moe")
    with pytest.raises(ExportRefused) as unwrapped:
        to_nnef(hf, tmp_path / "a.nnef.tgz")
    assert "not an FFN output" in str(unwrapped.value)
    model = moelens.wrap(hf)
    with pytest.raises(ExportRefused) as wrapped:
        to_nnef(model, tmp_path / "b.nnef.tgz")
    assert str(wrapped.value) == str(unwrapped.value)

    def my_hook(module, args, output):
        return output

    handle = model.moes[0]._module.register_forward_hook(my_hook)
    with pytest.raises(ExportRefused, match=r"layers\.1\.mlp\.text_moe has a forward hook \(my_hook\)"):
        to_nnef(model, tmp_path / "c.nnef.tgz")
    handle.remove()
    assert not list(tmp_path.iterdir())


# -- the moelens command ----------------------------------------------------------------------------------------------


def test_a_command_module_missing_a_dependency_is_not_hidden(monkeypatch, tmp_path):
    """A feature area that is not installed is left out of the command; an installed one whose own import fails
    (a dependency missing) raises rather than silently dropping its subcommands."""
    import moelens.cli as cli

    (tmp_path / "moelens_probe_area.py").write_text("import moelens_surely_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("moelens.no_such_area.commands", "moelens.commands.export"))
    assert "export" in cli.build_parser().format_help()
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("moelens_probe_area",))
    with pytest.raises(ModuleNotFoundError, match="moelens_surely_missing_dependency"):
        cli.build_parser()
    sys.modules.pop("moelens_probe_area", None)


def test_a_checkpoint_folder_named_tiny_wins_over_moelens_tiny(monkeypatch, tmp_path):
    """``tiny`` names the embedded moelens-tiny (a qwen2_moe) only when no folder of that name is there."""
    import warnings

    from moelens.cli import load_checkpoint
    from moelens.testing import tiny_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tiny_model("mixtral").save_pretrained(tmp_path / "tiny")
    monkeypatch.chdir(tmp_path)
    model, name = load_checkpoint("tiny")
    assert name == "tiny" and model.family.name == "mixtral"
    monkeypatch.chdir(tmp_path / "tiny")
    model, name = load_checkpoint("tiny")
    assert name == "moelens-tiny" and model.family.name == "qwen2_moe"


def test_a_checkpoint_with_served_moe_blocks_keeps_the_warning_about_the_others(tmp_path):
    """`load_checkpoint` holds back wrap's 'does not serve these MoE blocks' only for a model the command refuses
    (no served block); dots3_note serves its language model's blocks, and its vision tower's MoE blocks are named."""
    import warnings

    from transformers import AutoConfig, AutoModelForImageTextToText

    from moelens.cli import load_checkpoint
    from moelens.testing import tiny_config

    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, patch_size=4,
                  spatial_merge_size=2, adapter_in_dim=16, adapter_out_dim=32, adapter_merge_size=2,
                  moe_intermediate_size=16, pyramid_num_routed=[-1, 4], num_experts_per_tok=2)
    audio = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                 adapter_input_size=16, adapter_out_dim=32, feature_size=16, downsample_hidden_size=8)
    config = AutoConfig.for_model("dots3_note", text_config=tiny_config("dots3_note").to_dict(), vision_config=vision,
                                  audio_config=audio)
    AutoModelForImageTextToText.from_config(config).save_pretrained(tmp_path / "dots3")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, name = load_checkpoint(str(tmp_path / "dots3"))
    assert model.moes and all(not moe.path.startswith("model.vision_tower") for moe in model.moes)
    assert [str(w.message) for w in caught if "does not serve these MoE blocks of dots3_note: model.vision_tower.blocks"
            in str(w.message)]


def test_a_model_name_that_is_no_folder_is_refused_without_asking_the_hub(monkeypatch, tmp_path, capsys):
    """Commands take local folders only: a bare name that is not a folder here is refused before moelens.load
    (which would take it for a hub id)."""
    import moelens
    from moelens.cli import main

    def never(*args, **kwargs):
        raise AssertionError("moelens.load was called for a path that does not exist")

    monkeypatch.setattr(moelens, "load", never)
    monkeypatch.chdir(tmp_path)
    for command in (["inspect", "no-such-model"], ["export", "no-such-model", "x.nnef.tgz", "--no-verify"]):
        assert main(command) == 2
        assert "no model at 'no-such-model': the path does not exist" in capsys.readouterr().err


def test_standin_version_without_the_tract_package_names_the_extra(monkeypatch, capsys):
    """`--version` without the export extra was a bare ModuleNotFoundError traceback."""
    monkeypatch.setitem(sys.modules, "tract", None)  # import tract raises ImportError
    assert tract_cli.main(["--version"]) == 2
    assert capsys.readouterr().err == ("ERROR moelens tract stand-in needs the tract Python package: "
                                       "pip install 'moelens[export]'\n")
