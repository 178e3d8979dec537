"""The ``moelens demo / inspect / stats / generate`` commands: on moelens-tiny, on a tiny random model of
another family saved to disk, and clean one-line errors on bad input."""

from __future__ import annotations

import codecs
import importlib.util
import csv
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

import moelens
from groundtruth import ascii_tokenizer
from moelens import analysis
from moelens.cli import build_parser, main
from moelens.testing import tiny_inputs, tiny_model

#: `moelens export` refuses a missing export extra before the model loads: a refusal of the model needs the extra.
NEEDS_EXPORT_EXTRA = pytest.mark.skipif(not all(importlib.util.find_spec(name) for name in ("torch_to_nnef", "tract")),
                                        reason="the export extra is not installed (pip install 'moelens[export]')")

PNG = b"\x89PNG\r\n\x1a\n"
TEXT = "def add(a, b):\n    return a + b\n\nThe function add returns the sum of a and b.\n"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny random Mixtral and a dense Qwen2 (each with a tokenizer) saved as checkpoint folders, an OLMoE
    saved without a tokenizer, a folder with the Mixtral's config.json only, and a text file."""
    root = tmp_path_factory.mktemp("cli")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    models = {
        "mixtral": tiny_model("mixtral"),
        "dense": Qwen2ForCausalLM(Qwen2Config(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                              num_attention_heads=2, num_key_value_heads=2, vocab_size=128)),
    }
    for name, model in models.items():
        model.save_pretrained(root / name)
        ascii_tokenizer().save_pretrained(root / name)
    tiny_model("olmoe").save_pretrained(root / "no-tokenizer")  # the model only: no tokenizer files
    from transformers import JetMoeConfig, JetMoeForCausalLM  # MoE blocks moelens knows and does not serve

    JetMoeForCausalLM(JetMoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, kv_channels=8,
                                   num_key_value_heads=2, intermediate_size=32, num_local_experts=4,
                                   num_experts_per_tok=2)).save_pretrained(root / "jetmoe")
    (root / "config-only").mkdir()
    (root / "config-only" / "config.json").write_text((root / "mixtral" / "config.json").read_text())
    (root / "text.txt").write_text(TEXT, encoding="utf-8")
    (root / "empty.txt").write_text("", encoding="utf-8")
    (root / "bom-only.txt").write_bytes("\ufeff".encode())  # what Notepad saves as an empty UTF-8 file
    (root / "latin1.txt").write_bytes(b"abc\xff")
    (root / "bom-latin1.txt").write_bytes(codecs.BOM_UTF8 + b"abc\xff")  # the offset counts the mark too
    (root / "dangling").symlink_to(root / "missing-target")
    return root


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    status = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def pngs(folder: Path) -> list[str]:
    files = sorted(folder.glob("*.png"))
    for path in files:
        assert path.read_bytes()[:8] == PNG and path.stat().st_size > 5000, path
    return [path.name for path in files]


def test_help_lists_commands(capsys):
    parser = build_parser()
    text = parser.format_help()
    for command in ("demo", "inspect", "stats", "generate"):
        assert command in text
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args([command, "--help"])
        assert exit_info.value.code == 0
        assert "usage: moelens " + command in capsys.readouterr().out


def test_python_dash_m_moelens_runs_the_command_line():
    done = subprocess.run([sys.executable, "-m", "moelens", "inspect", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "usage: moelens inspect" in done.stdout, done.stderr[-2000:]


def test_help_and_a_refused_command_line_import_no_model_library():
    """moelens --help took 10 s, all of it importing torch, transformers and nnsight: the parsers and `import moelens`
    import none of them, a command's body only when it runs; and moelens' names still import on first use."""
    code = (
        "import sys, moelens, moelens.cli\n"
        "moelens.cli.build_parser().format_help()\n"
        "try:\n"
        "    moelens.cli.main(['stats', 'tiny'])\n"
        "except SystemExit as refused:\n"
        "    status = refused.code\n"
        "heavy = sorted(name for name in ('torch', 'transformers', 'nnsight', 'numpy') if name in sys.modules)\n"
        "print(status, heavy, moelens.wrap.__module__, moelens.Moe.__name__, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "2 [] moelens.model Moe True\n", (done.stdout, done.stderr[-2000:])
    assert "the following arguments are required: --text" in done.stderr


def test_console_script_loads_tiny_without_network():
    """The installed ``moelens`` script loads moelens-tiny with no hub flag set and every proxy dead."""
    script = Path(sys.executable).parent / "moelens"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "moelens.cli"]
    env = {key: value for key, value in os.environ.items() if key not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    dead = "http://127.0.0.1:9"  # the discard port: any download attempt fails at once
    env.update(HTTP_PROXY=dead, HTTPS_PROXY=dead, http_proxy=dead, https_proxy=dead, NO_PROXY="", no_proxy="")
    result = subprocess.run(command + ["inspect", "tiny", "--json"], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert "Loading weights" not in result.stderr  # transformers' progress bar is kept out of the commands
    report = json.loads(result.stdout)
    assert report["family"] == "qwen2_moe" and report["name"].endswith("moelens-tiny")


def test_demo_on_moelens_tiny(tmp_path, capsys, monkeypatch):
    """Every plot the demo names lands in --out (the held-out ones could go to the working folder unseen), and
    --text is the text routed and shown (the sample's routing could be shown under the file's name); --no-progress
    keeps the held-out windows' progress bar out (it could not be switched off)."""
    from moelens.analysis.cli import DEMO_FILES

    (tmp_path / "mine.txt").write_text("zebra quagga okapi", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    status, out, err = run(["demo", "--out", tmp_path / "demo", "--windows", "8", "--text", tmp_path / "mine.txt",
                            "--no-progress"], capsys)
    assert status == 0, err
    assert "routing" not in err
    header = next(line for line in out.splitlines() if line.startswith("token "))
    assert header.split()[1:3] == ["layer", "0"] and "layer 3" in header
    assert "cv" in out and "router_entropy" in out
    table = out[out.index(header):].split("\n\n")[0].splitlines()[2:]  # below the header and its rule
    assert "".join(row.split()[0] for row in table).replace("·", " ").startswith("zebra quagga"), table[:6]
    assert set(DEMO_FILES) <= set(pngs(tmp_path / "demo"))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["demo", "mine.txt"]  # nothing beside --out
    assert str((tmp_path / "demo").resolve()) in out


def test_the_demo_shows_the_first_64_tokens_of_a_long_text(tmp_path, capsys):
    """A 19 KB --text printed one table row per token (5,454 lines) while the token plot shows the first 64.
    Ground truth: the tokenizer's count of the text's tokens."""
    text = "def add(a, b):\n    return a + b\n" * 20
    (tmp_path / "long.txt").write_text(text, encoding="utf-8")
    count = len(moelens.load().tokenizer(text)["input_ids"])
    status, out, err = run(["demo", "--out", tmp_path / "demo", "--windows", "0", "--text", tmp_path / "long.txt"], capsys)
    assert status == 0, err
    assert count > 64
    header = next(line for line in out.splitlines() if line.startswith("token "))
    table = out[out.index(header):].split("\n\n")[0].splitlines()[2:]
    assert len(table) == 65 and table[-1] == f"... {count - 64} more tokens"
    assert f"({count} tokens)" in out


def test_ctrl_c_ends_a_command_with_a_line(tmp_path, capsys, monkeypatch):
    """Ctrl-C printed the traceback of wherever the model was (26 frames, down to torch's grouped_mm)."""
    import moelens.analysis.cli as analysis_cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(analysis_cli, "load_model", interrupted)
    status, out, err = run(["demo", "--out", tmp_path / "demo"], capsys)
    assert status == 130 and err == "\nmoelens demo: interrupted\n"


def test_the_demo_says_when_it_routes_fewer_windows_than_asked(tmp_path, capsys, monkeypatch):
    """--windows 999999 routed the 256 the held-out set has, saying only "256 windows"."""
    from safetensors.torch import load_file, save_file

    import moelens.data

    held = load_file(str(moelens.data.HELDOUT_PATH))
    save_file({name: tensor[:3].contiguous() for name, tensor in held.items()}, str(tmp_path / "held.safetensors"))
    monkeypatch.setattr(moelens.data, "HELDOUT_PATH", tmp_path / "held.safetensors")
    status, out, err = run(["demo", "--out", tmp_path / "demo", "--windows", "5"], capsys)
    assert status == 0, err
    assert "(3 windows of code and prose, all the held-out set has; --windows asked for 5)" in out


def test_the_demo_runs_moelens_tiny_beside_a_users_folder_named_tiny(tmp_path, capsys, monkeypatch):
    """`demo` takes no MODEL: a folder named tiny in the working folder (here a Mixtral checkpoint) is not loaded
    in place of moelens-tiny, as `inspect tiny` would (a user's folder of that name wins where MODEL is given)."""
    tiny_model("mixtral").save_pretrained(tmp_path / "tiny")
    ascii_tokenizer().save_pretrained(tmp_path / "tiny")
    monkeypatch.chdir(tmp_path)
    status, out, err = run(["demo", "--out", tmp_path / "demo", "--windows", "0"], capsys)
    assert status == 0, err
    assert "Qwen2MoeForCausalLM" in out and "Mixtral" not in out
    status, out, err = run(["inspect", "tiny"], capsys)
    assert status == 0 and "family                 mixtral" in out, err


def test_a_file_named_tiny_in_the_working_folder_leaves_moelens_tiny_to_the_name(tmp_path, capsys, monkeypatch):
    """docs/cli.md: a *folder* named tiny is taken for the user's. A file of that name hid moelens-tiny too (with the
    advice to pass '.', which holds no checkpoint), and an empty folder's refusal advised passing 'tiny'."""
    import moelens

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").write_text("notes\n")
    status, out, err = run(["inspect", "tiny"], capsys)
    assert status == 0 and "family                 qwen2_moe" in out, err
    assert moelens.load("tiny").config.model_type == "qwen2_moe"
    (tmp_path / "tiny").unlink()
    (tmp_path / "tiny").mkdir()
    status, out, err = run(["inspect", "tiny"], capsys)
    assert status == 2 and "no config.json in it); a folder named 'tiny' in the working folder is taken for yours, " \
        "and it hides the built-in moelens-tiny: pass 'moelens-tiny' for it." in err
    status, out, err = run(["inspect", "moelens-tiny"], capsys)
    assert status == 0 and "family                 qwen2_moe" in out, err


def test_a_file_passed_as_a_checkpoint_is_refused_with_its_folder_only_where_that_holds_one(tmp_path):
    import moelens

    loose = tmp_path / "weights.bin"
    loose.write_bytes(b"")
    with pytest.raises(moelens.MoelensError, match=r"is a file; .* holding config.json and the weights: pass that folder\."):
        moelens.load(loose)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(moelens.MoelensError, match=rf"is a file; .*: pass {re.escape(repr(str(tmp_path)))}\."):
        moelens.load(loose)
    # a model the user torch.saved beside a checkpoint: passing the folder would load the checkpoint, not this file
    pickled = tmp_path / "model.pt"
    torch.save(torch.nn.Linear(2, 2), pickled)
    with pytest.raises(moelens.MoelensError, match=rf"is a file; .*: this one was written by torch\.save.*"
                                                   rf"\(for the checkpoint beside it, pass {re.escape(repr(str(tmp_path)))}\)\."):
        moelens.load(pickled)
    own = tmp_path / "pytorch_model-00001-of-00002.bin"  # save_pretrained's own torch.save file: the folder
    torch.save({}, own)
    with pytest.raises(moelens.MoelensError, match=rf"is a file; .*: pass {re.escape(repr(str(tmp_path)))}\."):
        moelens.load(own)


def test_inspect_tiny(capsys):
    status, out, err = run(["inspect", "tiny"], capsys)
    assert status == 0, err
    assert "family                 qwen2_moe" in out
    assert "E=8, k=2" in out and "shared_expert" in out
    for value in ("router_logits", "expert_indices", "expert_outputs", "shared_expert_output", "mlp_output"):
        assert f"  {value} " in out


def test_inspect_counts_layers_not_blocks_and_names_each_block():
    """ernie4_5_vl_moe has a text and a vision MoE block per layer: it was "6 of 4" MoE layers."""
    import moelens
    from moelens.analysis.describe import describe

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = describe(moelens.wrap(tiny_model("ernie4_5_vl_moe")))
    blocks = [layer.path for layer in report.moe_layers]
    text = str(report)
    assert "tokenizer              none (token ids only)" in text
    assert f"MoE layers             1, 2, 3 (3 of 4), {len(blocks)} MoE blocks" in text and len(blocks) == 6
    assert "dense layers           0\n" in text
    titles = [line for line in text.splitlines() if line.startswith("values served, ")]
    assert titles == [f"values served, {path}, shapes for a [1, 4] input:" for path in blocks]
    assert any("text_moe" in path for path in blocks) and any("vision_moe" in path for path in blocks)


def test_a_report_prints_as_inspect_does_and_marks_recomputed_routing_read_only():
    """Jupyter showed a report as a one-line dataclass dump of 2,000 characters; llama4's expert_weights and
    expert_indices, recomputed from its logits (every write refused), were listed read/write."""
    import moelens
    from moelens.analysis.describe import describe

    pretty = pytest.importorskip("IPython.lib.pretty")
    report = describe(moelens.wrap(tiny_model("llama4")))
    text = str(report)
    assert pretty.pretty(report) == text and repr(report).startswith("ModelReport(name=")
    for name, access in (("router_logits", "read/write"), ("router_probs", "read-only (derived)"),
                         ("expert_weights", "read-only (derived)"), ("expert_indices", "read-only (derived)"),
                         ("mlp_output", "read/write")):
        assert re.search(rf"\n  {name} +\[[0-9, ]+\] +{re.escape(access)}\n", text), (name, text)
    mixtral = str(describe(moelens.wrap(tiny_model("mixtral"))))
    assert re.search(r"\n  expert_weights +\[1, 4, 2\] +read/write\n", mixtral)


def test_inspect_other_family(saved, capsys):
    status, out, err = run(["inspect", saved / "mixtral", "--json"], capsys)
    assert status == 0, err
    report = json.loads(out)
    assert report["family"] == "mixtral" and report["shared"] == "none"
    assert [layer["layer"] for layer in report["moe_layers"]] == [0, 1, 2, 3]
    first = report["moe_layers"][0]
    assert first["num_experts"] == 8 and first["top_k"] == 2
    assert first["values"]["router_logits"] == [1, 4, 8]
    assert first["values"]["expert_outputs"] == [1, 4, 2, 32]
    assert first["unavailable"]["shared_expert_output"].startswith(  # the why, without the value's path
        "the mixtral family has no shared expert.")


def test_stats_other_family_matches_the_analysis(saved, tmp_path, capsys):
    out_dir = tmp_path / "stats"
    status, out, err = run(["stats", saved / "mixtral", "--text", saved / "text.txt", "--out", out_dir,
                            "--no-progress"], capsys)
    assert status == 0, err
    assert f"{len(TEXT)} tokens" in out and "max_over_mean" in out
    document = json.loads((out_dir / "stats.json").read_text())
    cache = analysis.RoutingCache.load(out_dir / "cache")
    usage = analysis.expert_usage(cache)
    assert cache.num_tokens == len(TEXT)  # the ascii tokenizer: one token per character
    for row, layer in enumerate(document["layers"]):
        counts = usage.counts[row].double()
        assert layer["cv"] == pytest.approx(float(counts.std(correction=0) / counts.mean()))
        assert layer["max_over_mean"] == pytest.approx(float(counts.max() / counts.mean()))
    experts = list(csv.DictReader(io.StringIO((out_dir / "experts.csv").read_text())))
    assert sum(int(row["count"]) for row in experts) == len(TEXT) * 2 * 4
    assert len(list(csv.DictReader(io.StringIO((out_dir / "stats.csv").read_text())))) == 4
    assert {"usage.png", "load_balance.png", "entropy.png", "coactivation.png", "trajectories.png"} <= set(pngs(out_dir))


@pytest.mark.parametrize("content", [b"ab\r\ncd\r\n\r\nef\rg", b"  \n\t\n  "], ids=["crlf-and-cr", "whitespace-only"])
def test_stats_routes_the_files_own_characters(saved, tmp_path, capsys, content):
    """The file was read with universal newlines, so \\r\\n and \\r were routed as \\n (other tokens than the same text
    given to collect_routing), and a whitespace-only file was refused as empty, though it has tokens to route.
    Truth: the file's bytes, one token per character (the saved model's ascii tokenizer)."""
    text = tmp_path / "file.txt"
    text.write_bytes(content)
    status, out, err = run(["stats", saved / "mixtral", "--text", text, "--out", tmp_path / "stats", "--no-progress"],
                           capsys)
    assert status == 0, err
    cache = analysis.RoutingCache.load(tmp_path / "stats" / "cache")
    tokenizer = AutoTokenizer.from_pretrained(saved / "mixtral")
    assert cache.token_ids().tolist() == tokenizer(content.decode(), add_special_tokens=False)["input_ids"]
    assert cache.num_tokens == len(content)


@pytest.mark.parametrize("stop", ["third-plot", "statistics"])
def test_stats_stopped_while_writing_plots_leaves_no_earlier_runs_plot(saved, tmp_path, monkeypatch, capsys, stop):
    """Ctrl-C at the third plot of a second `stats` into one --out left the first run's later plots beside the
    second run's stats.json, passing for its own; stopped after its routing cache was written (computing the
    statistics), the first run's stats.json and plots beside it. Now each file there is the second run's or absent.
    Ground truth: the second run's files written to the end in a fresh folder."""
    from moelens.analysis import plots, report

    other = tmp_path / "other.txt"
    other.write_text("The quick brown fox jumps over the lazy dog. " * 8, encoding="utf-8")
    out, truth = tmp_path / "out", tmp_path / "truth"
    for text, folder in ((saved / "text.txt", out), (other, truth)):
        status, _, err = run(["stats", saved / "mixtral", "--text", text, "--out", folder, "--no-progress"], capsys)
        assert status == 0, err
    first = {path.name: path.read_bytes() for path in out.glob("*.png")}
    drawn, calls = plots.save, []

    def stopped_at_the_third(figure, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return drawn(figure, path, *args, **kwargs)

    def stopped(cache):
        raise KeyboardInterrupt

    if stop == "third-plot":
        monkeypatch.setattr(plots, "save", stopped_at_the_third)
    else:
        monkeypatch.setattr(report, "layer_stats", stopped)
    status, _, err = run(["stats", saved / "mixtral", "--text", other, "--out", out, "--no-progress"], capsys)
    assert status == 130 and "interrupted" in err
    left = {path.name: path.read_bytes() for path in out.glob("*.png")}
    assert len(left) == (2 if stop == "third-plot" else 0) and len(first) > 3
    assert all(content == (truth / name).read_bytes() for name, content in left.items())
    if stop == "third-plot":
        assert json.loads((out / "stats.json").read_text())["text"] == str(other)
    else:
        assert not (out / "stats.json").exists() and not (out / "stats.csv").exists()


def test_paths_from_the_home_folder_land_in_one_folder(saved, tmp_path, monkeypatch, capsys):
    """bash leaves ~ in --out=~/res as it is: the plots and the cache went to $HOME/res while stats.json went to
    ./~/res, and the message named the second."""
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    status, out, err = run(["stats", saved / "mixtral", "--text", saved / "text.txt", "--out=~/res", "--no-progress"],
                           capsys)
    assert status == 0, err
    assert {"stats.json", "experts.csv", "usage.png", "cache"} <= {p.name for p in (home / "res").iterdir()}
    assert not (tmp_path / "~").exists() and f"Wrote to {home / 'res'}" in out


def test_a_model_folder_from_the_home_folder_and_a_byte_order_mark(saved, tmp_path, monkeypatch, capsys):
    """MODEL '~/...' was refused as missing (moelens.load expands it); a text file starting with a UTF-8 byte-order
    mark was routed with the mark as three tokens more."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "mixtral").symlink_to(saved / "mixtral")
    monkeypatch.setenv("HOME", str(home))
    marked = tmp_path / "marked.txt"
    marked.write_bytes("\ufeff".encode() + TEXT.encode())
    counts = []
    for text in (saved / "text.txt", marked):
        status, out, err = run(["stats", "~/mixtral", "--text", text, "--format", "json", "--no-progress"], capsys)
        assert status == 0, err
        counts.append([row["tokens"] for row in json.loads(out)["layers"]])
    assert counts[0] == counts[1] == [len(TEXT)] * len(counts[0])


def test_stats_passes_its_options_on_and_names_the_text(saved, capsys, monkeypatch):
    """--max-length, --blocks and --threads reach the collection (each could be dropped unseen: only their
    refusals were tested), and the JSON names the text file."""
    from moelens.analysis import cli as analysis_cli
    from moelens.analysis import collect

    seen, threads = {}, []
    real = collect.collect_routing

    def spy(model, texts, **kwargs):
        seen.update(kwargs)
        return real(model, texts, **kwargs)

    monkeypatch.setattr(collect, "collect_routing", spy)
    monkeypatch.setattr(analysis_cli, "set_threads", threads.append)
    status, out, err = run(["stats", saved / "mixtral", "--text", saved / "text.txt", "--max-length", "8", "--blocks",
                            "mlp", "--threads", "1", "--format", "json", "--no-progress"], capsys)
    assert status == 0, err
    assert seen["max_length"] == 8 and seen["blocks"] == "mlp" and threads == [1]
    assert json.loads(out)["text"] == str(saved / "text.txt")


def test_corpus_plots_draw_every_layer_and_consecutive_layers_forward(monkeypatch, tmp_path):
    """The trajectories are layer i -> i+1 (not reversed) and co-activation has one panel per layer."""
    import moelens
    from moelens.analysis import plots
    from moelens.analysis.cli import write_corpus_plots

    drawn = {}
    for name in ("plot_coactivation", "plot_transitions"):
        real = getattr(plots, name)
        monkeypatch.setattr(plots, name, lambda items, real=real, name=name: drawn.setdefault(name, items) and real(items))
    hf = tiny_model("mixtral")
    cache = analysis.collect_routing(moelens.wrap(hf), [tiny_inputs(hf)["input_ids"][0]], progress=False)
    write_corpus_plots(cache, tmp_path)
    assert [panel.layer for panel in drawn["plot_coactivation"]] == cache.layers
    assert [(pair.source, pair.target) for pair in drawn["plot_transitions"]] == list(zip(cache.layers, cache.layers[1:]))


def test_a_system_error_on_a_path_is_bad_input_in_one_line(saved, tmp_path, capsys, monkeypatch):
    """An OSError no check foresaw (here: writing a plot is refused) exits 2, as docs/cli.md says of bad input."""
    from moelens.analysis import plots

    def refused(figure, path, dpi=110):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(plots, "save", refused)
    status, out, err = run(["stats", saved / "mixtral", "--text", saved / "text.txt", "--out", tmp_path / "s",
                            "--no-progress"], capsys)
    assert status == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("moelens stats: error: [Errno 13] Permission denied") and "check the path" in err


def test_stats_formats_on_tiny(saved, capsys):
    status, out, err = run(["stats", "tiny", "--text", saved / "text.txt", "--format", "json", "--no-progress"], capsys)
    assert status == 0, err
    rows = json.loads(out)["layers"]
    assert [row["layer"] for row in rows] == [0, 1, 2, 3]
    assert all(0 <= row["router_entropy"] <= 1 and row["experts"] == 8 for row in rows)
    status, out, err = run(["stats", "tiny", "--text", saved / "text.txt", "--format", "csv", "--no-progress"], capsys)
    assert status == 0, err
    assert out.splitlines()[0].startswith("layer,tokens,experts,top_k,cv")
    assert len(out.splitlines()) == 5


def _linked(tmp_path, target, out, how: str):
    """(--text, --out) for the file ``target`` and the folder ``out`` reached as ``how`` says: through a symbolic link
    to the file ("link-to-it"), with --out given as a symbolic link ("out-through-a-link"), through a hard link to the
    file ("hard-link"), else directly."""
    text, out_arg = target, out
    if how == "link-to-it":
        text = tmp_path / "text-link.txt"
        text.symlink_to(target)
    elif how == "out-through-a-link":
        out_arg = tmp_path / "notes-link"
        out_arg.symlink_to(out, target_is_directory=True)
    elif how == "hard-link":
        text = tmp_path / "hard.txt"
        os.link(target, text)
    return text, out_arg


@pytest.mark.parametrize("command, how", [
    *(("stats", how) for how in ("same-path", "link-to-it", "out-through-a-link", "hard-link", "in-the-cache")),
    *(("demo", how) for how in ("same-path", "link-to-it", "out-through-a-link", "hard-link")),  # no cache
])
def test_a_text_file_the_results_would_overwrite_is_refused_before_any_work(saved, tmp_path, capsys, command, how):
    """`moelens stats tiny --text notes/stats.csv --out notes` wrote its results CSV over its own input text."""
    out = tmp_path / "notes"
    out.mkdir()
    written = {"stats": "stats.csv", "demo": "text_usage.png"}[command]
    target = out / ("cache/notes.txt" if how == "in-the-cache" else written)
    target.parent.mkdir(exist_ok=True)
    target.write_text(TEXT)
    text, out_arg = _linked(tmp_path, target, out, how)
    before = sorted(path.relative_to(out) for path in out.rglob("*"))
    argv = ["stats", saved / "mixtral", "--no-progress"] if command == "stats" else ["demo", "--windows", "0"]
    status, printed, err = run([*argv, "--text", text, "--out", out_arg], capsys)
    assert status == 2 and "Traceback" not in err
    lines = [line for line in err.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith(f"moelens {command}: error: --text {str(text)!r} "), err
    assert "overwrite" in lines[0] or "routing cache folder 'cache'" in lines[0], lines[0]
    assert target.read_text() == TEXT and sorted(path.relative_to(out) for path in out.rglob("*")) == before


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["inspect", "{root}/nowhere"], "no model at"),
        (["inspect", "{root}"], "not a transformers checkpoint folder"),
        (["inspect", "{root}/dense"], "not a Mixture-of-Experts model"),
        (["stats", "{root}/dense", "--text", "{root}/text.txt"], "not a Mixture-of-Experts model"),
        (["stats", "{root}/mixtral", "--text", "{root}/empty.txt"], "empty.txt' is empty; give it some text"),
        (["stats", "{root}/mixtral", "--text", "{root}/missing.txt"], "does not exist"),
        (["demo", "--text", "{root}/empty.txt"], "is empty"),
        (["stats", "{root}/mixtral", "--text", "{root}/bom-only.txt"], "bom-only.txt' is empty; give it some text"),
        (["stats", "{root}/mixtral", "--text", "{root}/latin1.txt"], "is not UTF-8 text (invalid start byte at byte 3)"),
        (["stats", "{root}/mixtral", "--text", "{root}/bom-latin1.txt"], "is not UTF-8 text (invalid start byte at byte 6)"),
        (["stats", "{root}/mixtral", "--text", "{root}"], "is a folder; give a text file"),
        (["stats", "{root}/mixtral", "--text", "{root}/text.txt", "--out", "{root}/text.txt"], "is a file; name a folder"),
        (["stats", "{root}/mixtral", "--text", "{root}/text.txt", "--max-length", "0"], "--max-length must be at least 1, got 0"),
        (["demo", "--out", "{root}/text.txt"], "is a file; name a folder"),
        (["demo", "--windows", "-1"], "--windows must be 0 (none) or more"),
        pytest.param(["export", "tiny", "{root}/x.nnef.tgz", "--tokens", "0", "--no-verify"], "need at least one token",
                     marks=NEEDS_EXPORT_EXTRA),
        (["export", "tiny", "{root}", "--block", "0", "--no-verify"], "is a folder with files of its own"),
        (["stats", "{root}/no-tokenizer", "--text", "{root}/text.txt"], "has no tokenizer"),
        (["inspect", "{root}/config-only"], "holds config.json but no weights file"),
        pytest.param(["export", "{root}/config-only", "{root}/x.nnef.tgz", "--no-verify"],
                     "holds config.json but no weights file", marks=NEEDS_EXPORT_EXTRA),
        (["stats", "{root}/mixtral", "--text", "{root}/text.txt", "--out", "{root}/text.txt/sub"], "which is a file"),
        (["demo", "--out", "{root}/text.txt/sub", "--windows", "0"], "which is a file"),
        (["export", "tiny", "{root}/text.txt/x.nnef.tgz", "--no-verify", "--tokens", "2"], "which is a file"),
        (["export", "tiny", "{root}/x.nnef.tgz", "--no-verify", "--tokens", "2", "--steer", "2:5=1", "--steer", "2:5=2"],
         "expert 5 of layer 2 is given twice"),
        (["stats", "{root}/mixtral", "--text", "{root}/text.txt", "--out", "{root}/dangling/sub"],
         "dangling', which is a symbolic link to a missing path"),
        (["demo", "--out", "{root}/dangling/sub", "--windows", "0"], "dangling', which is a symbolic link to a missing path"),
        (["export", "tiny", "{root}/dangling/x.nnef.tgz", "--no-verify", "--tokens", "2"],
         "dangling', which is a symbolic link to a missing path"),
        pytest.param(["demo", "--out", "/proc/moelens-out", "--windows", "0"], "/proc",
                     marks=pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs Linux's /proc")),
    ],
    ids=["unknown-path", "not-a-checkpoint", "inspect-dense", "stats-dense", "empty-text", "missing-text", "demo-empty",
         "byte-order-mark-only", "not-utf8", "not-utf8-after-a-byte-order-mark",
         "text-is-a-folder", "stats-out-is-a-file", "max-length-0", "demo-out-is-a-file", "negative-windows",
         "export-no-tokens", "export-into-a-folder-of-files", "stats-no-tokenizer", "inspect-no-weights",
         "export-no-weights", "stats-out-under-a-file", "demo-out-under-a-file", "export-under-a-file",
         "export-steer-twice", "stats-out-under-a-dangling-link", "demo-out-under-a-dangling-link",
         "export-under-a-dangling-link", "demo-out-the-system-refuses"],
)
def test_bad_input_fails_cleanly(saved, capsys, argv, message):
    status, out, err = run([arg.format(root=saved) for arg in argv], capsys)
    assert status == 2
    lines = [line for line in err.splitlines() if "error" in line.lower()]  # (progress bars aside)
    assert len(lines) == 1 and lines[0].startswith(f"moelens {argv[0]}: error: ") and message in lines[0], err
    assert "Traceback" not in err


def test_inspect_of_a_checkpoint_without_tokenizer_says_it_has_none(saved, capsys):
    status, out, err = run(["inspect", saved / "no-tokenizer"], capsys)
    assert status == 0, err
    assert "tokenizer              none (token ids only)" in out


@pytest.mark.parametrize("edits", [["--steer", "2:5=1.0", "--steer", "2:5=2.0"], ["--steer", "2:5=1,5=2"],
                                   ["--swap", "1:2=3", "--swap", "1:2=4"]], ids=["steer", "steer-one-option", "swap"])
def test_export_refuses_an_expert_edited_twice(edits):
    from moelens.errors import MoelensError
    from moelens.export.cli import parse_edits

    args = build_parser().parse_args(["export", "tiny", "x.nnef.tgz", *edits])
    with pytest.raises(MoelensError, match=r"expert \d of layer \d is given twice"):
        parse_edits(args)


@pytest.mark.parametrize("edit, example", [(["--swap", "1:2=2.5"], "LAYER:EXPERT=TO with TO an expert id, e.g. 2:4=0"),
                                           (["--steer", "1:2=big"], "LAYER:EXPERT=BIAS, e.g. 2:4=1.5")],
                         ids=["swap", "steer"])
def test_export_edit_specs_are_explained_in_their_own_terms(edit, example):
    from moelens.errors import MoelensError
    from moelens.export.cli import parse_edits

    args = build_parser().parse_args(["export", "tiny", "x.nnef.tgz", *edit])
    with pytest.raises(MoelensError, match=re.escape(f"--{edit[0][2:]} {edit[1]!r}: expected {example}")):
        parse_edits(args)


def test_export_never_replaces_an_archive_of_the_users(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("kept\n")
    user = tmp_path / "backup.tar"
    with tarfile.open(user, "w") as tar:
        tar.add(tmp_path / "notes.txt", arcname="notes.txt")
    before = user.read_bytes()
    status, out, err = run(["export", "tiny", user, "--no-verify", "--tokens", "2"], capsys)
    assert status == 2 and "backup.tar' is a file that is not an NNEF export" in err, err
    assert user.read_bytes() == before


def test_missing_tiny_checkpoint_is_a_clean_error(monkeypatch, tmp_path, capsys):
    import moelens.data

    monkeypatch.setattr(moelens.data, "TINY_MODEL_PATH", tmp_path / "moelens-tiny")
    status, out, err = run(["inspect", "tiny"], capsys)
    assert status == 2 and "moelens-tiny is not installed" in err


def test_no_command_prints_help(capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        status, out, err = run([], capsys)
        assert status == 1 and "demo" in out
        assert torch.get_num_threads() == 2  # no command: the thread count is left alone
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("command", [["inspect", "{root}/dense"], ["stats", "{root}/dense", "--text", "{root}/text.txt"],
                                     pytest.param(["export", "{root}/dense", "{root}/dense.nnef.tgz", "--no-verify"],
                                                  marks=NEEDS_EXPORT_EXTRA),
                                     ["inspect", "{root}/mixtral/config.json"], ["inspect", "{root}/jetmoe"],
                                     pytest.param(["export", "{root}/jetmoe", "{root}/jetmoe.nnef.tgz", "--no-verify"],
                                                  marks=NEEDS_EXPORT_EXTRA)])
def test_refusals_of_a_checkpoint_are_one_line(saved, capsys, command):
    """No warning comes before the error line (the dense model's 'found no MoE block'), and a file
    inside a checkpoint is named as such."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        status, out, err = run([part.format(root=saved) for part in command], capsys)
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert not [warning for warning in caught if "moelens" in str(warning.message)]
    if command[1].endswith("config.json"):
        assert "is a file; moelens.load takes the checkpoint folder" in err
    if command[1].endswith("jetmoe"):  # the line says why, not "has no MoE block"
        assert "has MoE blocks moelens does not serve (JetMoeMoE, JetMoeMoA: its MLP and its attention" in err


def test_a_reader_closing_the_pipe_early_ends_quietly(tmp_path):
    """`moelens stats ... | head -1` said "Broken pipe; check the path" and exited 2."""
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat. " * 20)
    command = [sys.executable, "-m", "moelens.cli", "stats", "tiny", "--text", str(text), "--no-progress",
               "--format", "json"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()  # the reader is gone before the command writes
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=300) == 1
    assert "Broken pipe" not in stderr and "Traceback" not in stderr, stderr


@pytest.mark.parametrize("family", ["step3p7", "ernie4_5_vl_moe"])
def test_load_a_text_decoder_saved_without_architectures(family, tmp_path):
    """A multimodal family's text decoder (step3p7's model_type step3p5) has no auto class: without
    `architectures` in its config, load failed with transformers' list of every config class."""
    hf = tiny_model(family)
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("architectures", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = moelens.load(tmp_path)
    assert type(loaded._module) is type(hf) and loaded.family.name == family
    loaded._module.to(hf.device)  # where the tests' tiny models run (tests/conftest.py)
    inputs = tiny_inputs(hf)
    with torch.no_grad():
        torch.testing.assert_close(loaded._module(**inputs).last_hidden_state, hf(**inputs).last_hidden_state)


@pytest.mark.parametrize("command", [["demo"], ["stats", "tiny", "--text"]], ids=["demo", "stats"])
def test_an_out_folder_that_may_not_be_written_into_is_refused_before_any_work(saved, read_only_folder, command,
                                                                                 capsys):
    """An existing --out folder that may not be written into was found only when the demo wrote its first plot,
    after the whole run and its printed tables."""
    command = [*command, saved / "text.txt"] if command[0] == "stats" else command
    status, out, err = run([*command, "--out", read_only_folder], capsys)
    assert status == 2 and out == ""
    assert "read-only' is a folder this user may not write into" in err
    status, out, err = run([*command, "--out", read_only_folder / "sub"], capsys)
    assert status == 2 and "read-only', a folder this user may not write into" in err

def _out_with_cache_text(tmp_path, nested: bool):
    from moelens.analysis.cli import STATS_CACHE

    out = tmp_path / "notes"
    target = out / STATS_CACHE / ("sub/notes.txt" if nested else "notes.txt")
    target.parent.mkdir(parents=True)
    target.write_text("some text\n")
    return out, target


@pytest.mark.parametrize("how", ["nested", "link-to-it", "out-through-a-link"])
def test_a_text_in_the_routing_cache_is_refused_however_it_is_reached(tmp_path, how):
    """The file lies in --out's cache folder: deeper in it, through a link to it, or with --out given as a link."""
    from moelens.analysis.cli import STATS_CACHE, STATS_OUTPUTS, check_output_folder
    from moelens.errors import MoelensError

    out, target = _out_with_cache_text(tmp_path, nested=how == "nested")
    text, out_arg = _linked(tmp_path, target, out, how)
    if how == "out-through-a-link":
        text = out_arg / STATS_CACHE / "notes.txt"
    assert text.resolve().is_relative_to((out / STATS_CACHE).resolve())  # the file system's own answer
    with pytest.raises(MoelensError, match=r"lies in the routing cache folder 'cache'"):
        check_output_folder(out_arg, STATS_OUTPUTS, STATS_CACHE, text=text)
    check_output_folder(out_arg, STATS_OUTPUTS, STATS_CACHE, text=tmp_path / "elsewhere.txt")  # another text: fine


@pytest.mark.parametrize("argv", [["stats", "tiny", "--text", "TEXT", "--out", ""], ["demo", "--out", ""],
                                  ["demo", "--text", ""], ["stats", "tiny", "--text", ""], ["export", "tiny", ""]])
def test_an_empty_path_argument_is_a_usage_error_not_the_working_folder(argv, tmp_path, capsys, monkeypatch):
    """--out "" (an unset $OUTDIR) was taken as the working folder: stats wrote its files there, replacing a user's
    stats.csv, and exited 0."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "text.txt").write_text("def f(x):\n    return x + 1\n")
    (tmp_path / "stats.csv").write_text("my own notes")
    with pytest.raises(SystemExit) as exit_info:
        main([arg.replace("TEXT", "text.txt") for arg in argv])
    assert exit_info.value.code == 2
    assert re.search(r"error: argument (--out|--text|OUT): empty: name a file or folder", capsys.readouterr().err)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["stats.csv", "text.txt"]
    assert (tmp_path / "stats.csv").read_text() == "my own notes"


def _with_reader_gone(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    """A command run with the reader of its stdout gone before it writes (`| head -0`): its status and stderr."""
    process = subprocess.Popen([sys.executable, "-m", "moelens.cli", *argv], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=env)
    process.stdout.close()
    stderr = process.stderr.read().decode()
    return process.wait(timeout=300), stderr


@pytest.mark.parametrize("buffered", [False, True], ids=["unbuffered", "buffered"])
def test_stats_out_is_complete_when_the_reader_of_stdout_stops_early(tmp_path, capsys, buffered):
    """`moelens stats ... --out DIR | head -1` stopped at its first line: DIR held the new run's cache beside the
    last run's stats.json. Unbuffered, the files are now those of a run read to the end; buffered, the output's
    flush at exit said "Exception ignored ... BrokenPipeError" (status 120)."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}
    env |= {"OMP_NUM_THREADS": "1"} | ({} if buffered else {"PYTHONUNBUFFERED": "1"})
    text = tmp_path / "long.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 40)
    reference, out = tmp_path / "reference", tmp_path / "out"
    argv = ["stats", "tiny", "--text", str(text), "--no-progress", "--threads", "1"]
    threads = torch.get_num_threads()
    try:  # the run read to the end
        assert run([*argv, "--out", reference], capsys)[0] == 0
    finally:
        torch.set_num_threads(threads)
    out.mkdir()
    for name in ("stats.json", "stats.csv", "experts.csv"):  # a last run's files, to be replaced
        (out / name).write_text("an earlier run's\n")
    status, stderr = _with_reader_gone([*argv, "--out", str(out)], env)
    assert status == 1 and not re.search("Traceback|Exception ignored|Broken pipe", stderr), stderr
    for name in ("stats.json", "stats.csv", "experts.csv"):
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name
    assert pngs(out) == pngs(reference)
    assert (analysis.RoutingCache.load(out / "cache").num_tokens
            == json.loads((out / "stats.json").read_text())["layers"][0]["tokens"])


def test_demo_writes_every_plot_when_the_reader_of_stdout_stops_early(tmp_path):
    """`moelens demo | head -1` ended at its second line, before any plot: --out kept an earlier run's plots."""
    from moelens.analysis.cli import DEMO_FILES

    out = tmp_path / "demo"
    out.mkdir()
    for name in DEMO_FILES:
        (out / name).write_bytes(PNG + b"an earlier run's plot")  # a PNG: anything else is refused as the user's
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    status, stderr = _with_reader_gone(["demo", "--out", str(out), "--windows", "2"], env)
    assert status == 1 and "Traceback" not in stderr, stderr
    assert pngs(out) == sorted(DEMO_FILES)  # each one a new plot


def _unknown_user() -> str:
    """A user name the system's user database does not know."""
    import pwd

    name = "nosuchuser"
    while True:
        try:
            pwd.getpwnam(name)
        except KeyError:
            return name
        name += "x"


@pytest.mark.parametrize("argv, name", [
    (["stats", "tiny", "--text", "{home}/t.txt"], "argument --text: path"),
    (["stats", "tiny", "--text", "TEXT", "--out", "{home}/res"], "argument --out: path"),
    (["inspect", "{home}/model"], "MODEL"),
    (["export", "tiny", "{home}/x.nnef.tgz", "--no-verify"], "OUT"),
])
def test_a_home_folder_of_no_known_user_is_refused_by_name(saved, tmp_path, monkeypatch, capsys, argv, name):
    """`~nosuchuser/x` anywhere ended in pathlib's traceback "Could not determine home directory"."""
    home = "~" + _unknown_user()
    monkeypatch.chdir(tmp_path)
    argv = [arg.format(home=home).replace("TEXT", str(saved / "text.txt")) for arg in argv]
    given = next(arg for arg in argv if arg.startswith(home))
    expected = (f"{name} {given!r} begins with {home!r}, but this system knows no home folder of a user "
                f"{home[1:]!r}; write the path out without it (a folder named {home!r} here is ./{home}).")
    try:
        status = main(argv)
    except SystemExit as exit_info:  # an option's value: argparse's usage error
        status = exit_info.code
    err = capsys.readouterr().err
    assert status == 2 and err.endswith(f"error: {expected}\n"), err
    assert list(tmp_path.iterdir()) == []


def test_the_api_refuses_a_home_folder_of_no_known_user_and_expands_a_known_one():
    import pwd

    from moelens.errors import MoelensError
    from moelens.paths import user_path

    home = "~" + _unknown_user()
    with pytest.raises(MoelensError, match=re.escape(f"path '{home}/model' begins with '{home}'")):
        moelens.load(f"{home}/model")
    me = pwd.getpwuid(os.getuid())
    assert user_path(f"~{me.pw_name}/x") == Path(me.pw_dir) / "x"


@pytest.mark.parametrize("folder", ["max_length=4", "batch_size"])
def test_a_model_folder_named_like_a_setting_is_named_as_given(saved, tmp_path, monkeypatch, capsys, folder):
    """A dense model in a folder `max_length=4` was reported as "--max-length 4 is not a Mixture-of-Experts model"."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / folder).symlink_to(saved / "dense")
    status, out, err = run(["stats", folder, "--text", saved / "text.txt"], capsys)
    assert status == 2 and err.startswith(f"moelens stats: error: {folder!r} is not a Mixture-of-Experts model"), err


def test_stats_removes_an_earlier_runs_trajectories_when_this_model_has_one_moe_layer(saved, tmp_path, capsys):
    """docs/cli.md: --out writes trajectories.png, replacing a file of that name. A model with one MoE layer makes no
    trajectories, and an earlier run's trajectories.png stayed beside the new stats, passing for this run's.
    Truth: the checkpoint's config (decoder_sparse_step=2 of 2 layers: one MoE layer, layer 1)."""
    one = tmp_path / "one-moe-layer"
    tiny_model("qwen3_moe", num_hidden_layers=2, decoder_sparse_step=2, mlp_only_layers=[]).save_pretrained(one)
    ascii_tokenizer().save_pretrained(one)
    out = tmp_path / "stats"
    (out / "mine.png").parent.mkdir()
    (out / "mine.png").write_bytes(PNG)  # a file of the user's: no name moelens writes, so it stays
    argv = ["--text", saved / "text.txt", "--out", out, "--no-progress"]
    status, _, err = run(["stats", saved / "mixtral", *argv], capsys)  # four MoE layers: trajectories drawn
    assert status == 0 and (out / "trajectories.png").is_file(), err
    status, printed, err = run(["stats", one, *argv], capsys)
    assert status == 0, err
    assert [row["layer"] for row in json.loads((out / "stats.json").read_text())["layers"]] == [1]
    assert not (out / "trajectories.png").exists() and (out / "mine.png").read_bytes() == PNG
    assert "removed trajectories.png of an earlier run: this run routed one MoE layer (1)" in printed
    status, _, err = run(["stats", saved / "mixtral", *argv], capsys)
    assert status == 0 and (out / "trajectories.png").is_file(), err
    status, printed, err = run(["stats", one, *argv, "--format", "json"], capsys)
    assert status == 0 and json.loads(printed)["layers"][0]["layer"] == 1  # stdout stays one JSON document
    assert "removed trajectories.png of an earlier run" in err and not (out / "trajectories.png").exists()


def test_the_demo_without_held_out_windows_removes_an_earlier_runs_held_out_plots(tmp_path, capsys, monkeypatch):
    """`moelens demo --windows 0` makes no heldout_*.png, and an earlier run's stayed in --out beside this run's
    plots, passing for them. Truth: the held-out plots the first run wrote (DEMO_FILES' heldout_ names)."""
    from safetensors.torch import load_file, save_file

    import moelens.data
    from moelens.analysis.cli import DEMO_FILES

    held = load_file(str(moelens.data.HELDOUT_PATH))  # two windows: the first run stays quick
    save_file({name: tensor[:2].contiguous() for name, tensor in held.items()}, str(tmp_path / "held.safetensors"))
    monkeypatch.setattr(moelens.data, "HELDOUT_PATH", tmp_path / "held.safetensors")
    out = tmp_path / "demo"
    status, _, err = run(["demo", "--out", out, "--windows", "2"], capsys)
    held_out = sorted(name for name in DEMO_FILES if name.startswith("heldout_"))
    assert status == 0 and set(held_out) <= set(pngs(out)), err
    status, printed, err = run(["demo", "--out", out, "--windows", "0"], capsys)
    assert status == 0, err
    assert set(pngs(out)) == set(DEMO_FILES) - set(held_out)
    removed = [line for line in printed.splitlines() if line.startswith("removed ")]
    assert removed == [f"removed {name} of an earlier run: --windows 0 routes no held-out windows"
                       for name in DEMO_FILES if name.startswith("heldout_")]


def _unloadable_tokenizer(saved: Path, folder: Path) -> tuple[Path, str]:
    """A copy of the saved Mixtral checkpoint whose tokenizer.json holds text that is no JSON, and why that file
    does not load as json itself words it (the truth the commands must name)."""
    import shutil

    shutil.copytree(saved / "mixtral", folder)
    (folder / "tokenizer.json").write_text("garbage\n")
    try:
        json.loads("garbage\n")
    except json.JSONDecodeError as error:
        return folder, f"JSONDecodeError: {error}"
    raise AssertionError("'garbage' parsed as JSON")


def test_stats_names_saved_tokenizer_files_that_do_not_load(saved, tmp_path, capsys):
    """A checkpoint whose tokenizer files exist but do not load was refused as having "no tokenizer ... save one
    with the model" (it has one). Truth: the folder holds tokenizer files; json's own error on tokenizer.json."""
    folder, why = _unloadable_tokenizer(saved, tmp_path / "model")
    assert (folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file()
    status, out, err = run(["stats", folder, "--text", saved / "text.txt", "--no-progress"], capsys)
    lines = err.splitlines()
    assert status == 2 and len(lines) == 1, err  # the error alone: no warning saying the same before it
    expected = f"moelens stats: error: the tokenizer saved at {str(folder)!r} does not load ({why})"
    assert lines[0].startswith(expected), err
    assert "fix or re-save the tokenizer files" in lines[0] and "has no tokenizer" not in err and "Traceback" not in err


def test_a_warning_of_moelens_load_is_one_line_of_the_command(saved, tmp_path):
    """moelens.load's warnings were re-raised with their file and line, so Python printed a path of the installed
    package and a line of moelens' source (``  model = moelens.load(path)``) on stderr. Truth: json's own error on
    the tokenizer.json the checkpoint holds; the command still reports the model, with no tokenizer."""
    folder, why = _unloadable_tokenizer(saved, tmp_path / "model")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "moelens", "inspect", str(folder)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert "tokenizer              none (token ids only)" in done.stdout
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"moelens inspect: warning: moelens.load: the tokenizer saved at {str(folder)!r} does "
                               f"not load ({why}), so the model takes token ids only"), done.stderr
    assert "moelens.load(path)" not in done.stderr and ".py:" not in done.stderr and "UserWarning" not in done.stderr


def test_a_text_file_that_is_not_utf8_is_refused_with_how_to_convert_it(saved, capsys):
    """The error named the file and the byte but not what to do about it. Truth: where Python's own UTF-8
    decoder stops in the file's bytes."""
    path = saved / "latin1.txt"
    with pytest.raises(UnicodeDecodeError) as decoded:
        path.read_bytes().decode("utf-8")
    status, out, err = run(["stats", saved / "mixtral", "--text", path], capsys)
    lines = err.splitlines()
    assert status == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"moelens stats: error: text file {str(path)!r} is not UTF-8 text "
                               f"({decoded.value.reason} at byte {decoded.value.start}); convert it to UTF-8"), err
    assert "iconv -f ENCODING -t utf-8" in lines[0]


def test_a_checkpoint_with_its_own_code_is_refused_without_a_prompt(tmp_path, capsys):
    """A folder whose config.json names code of its own (auto_map): transformers asked "Do you wish to run the custom
    code? [y/N]" on the terminal, then the command refused with advice it has no option for (pass
    trust_remote_code=True); moelens.load added "fix your config.json" to it. (Not loaded with trust_remote_code=True:
    transformers would copy the code into the user's module cache.)"""
    from safetensors.torch import save_file

    model = tiny_model("mixtral")
    model.config.save_pretrained(tmp_path)
    save_file({key: value.contiguous() for key, value in model.state_dict().items()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    (tmp_path / "configuration_custom.py").write_text(
        "from transformers import MixtralConfig\n\nclass MyConfig(MixtralConfig):\n    model_type = 'mymixtral'\n")
    (tmp_path / "modeling_custom.py").write_text(
        "import transformers\nfrom .configuration_custom import MyConfig\n\n"
        "class MyForCausalLM(transformers.MixtralForCausalLM):\n    config_class = MyConfig\n")
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type="mymixtral", architectures=["MyForCausalLM"],
                  auto_map={"AutoConfig": "configuration_custom.MyConfig",
                            "AutoModelForCausalLM": "modeling_custom.MyForCausalLM"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["inspect", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert "holds a model with code of its own (config.json's auto_map), which moelens commands do not run; load it " \
           "in Python, moelens.load(path, trust_remote_code=True)" in error and "[y/N]" not in error
    with pytest.raises(moelens.MoelensError, match=r"trust_remote_code=True.*\(That code runs in this process: trust "
                                                   r"it first\.\)$") as refused:
        moelens.load(tmp_path, trust_remote_code=False)
    assert "fix it" not in str(refused.value)
    # a model type transformers knows: its own class runs in place of the checkpoint's code (which raises), said so
    (tmp_path / "modeling_custom.py").write_text("raise RuntimeError('the checkpoint code ran')\n")
    config.update(model_type="mixtral")
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["inspect", str(tmp_path)]) == 0
    error = capsys.readouterr().err
    assert "holds code of its own (config.json's auto_map), which moelens commands do not run: transformers' own " \
           "MixtralForCausalLM runs in its place" in error, error


def test_generate_prints_the_plain_greedy_text_and_the_routing_of_every_token_read(capsys):
    """The text is what transformers' own greedy generate makes of the prompt's ids, and the JSON's experts and
    weights are each read token's, as torch hooks on the experts recorded them step by step during a plain
    generation (the prompt's tokens, then one new token per step, the last generated token unread)."""
    from test_generation_routing import expected_routing, plain_generation

    reference = moelens.load()
    ids = reference.tokenizer("def mean(values):", add_special_tokens=False)["input_ids"]
    out, _, calls, _ = plain_generation(reference._module, [ids], 0)  # NEW = 6 tokens, greedy
    text = reference.tokenizer.decode(out[0, len(ids):])
    status, printed, err = run(["generate", "tiny", "--prompt", "def mean(values):", "--max-new-tokens", 6], capsys)
    assert status == 0, err
    assert f"generated  {text!r}" in printed
    rows = printed[printed.index("token "):].splitlines()[2:]
    assert len(rows) == len(ids) + 5
    status, printed, err = run(["generate", "tiny", "--prompt", "def mean(values):", "--max-new-tokens", 6,
                                "--layers", 1, 3, "--json"], capsys)
    assert status == 0, err
    report = json.loads(printed)
    assert report["generated"] == text and report["token_ids"] == ids + out[0, len(ids):-1].tolist()
    assert report["layers"] == [1, 3]
    for row, layer in enumerate(report["layers"]):
        indices, weights = expected_routing(calls[f"model.layers.{layer}.mlp.experts"], [ids], len(ids), [6])
        order = torch.argsort(weights, dim=-1, descending=True, stable=True)  # the table lists a token's slots by weight
        assert report["experts"][row] == indices.gather(-1, order).tolist()
        torch.testing.assert_close(torch.tensor(report["weights"][row]), weights.gather(-1, order), atol=1e-6, rtol=0)


def test_generate_samples_with_its_seed_as_transformers_does(capsys):
    reference = moelens.load()
    ids = reference.tokenizer("import", add_special_tokens=False)["input_ids"]
    torch.manual_seed(3)
    with torch.no_grad():
        out = reference._module.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                         max_new_tokens=5, do_sample=True)
    status, printed, err = run(["generate", "tiny", "--prompt", "import", "--max-new-tokens", 5, "--sample",
                                "--seed", 3, "--json"], capsys)
    assert status == 0, err
    assert json.loads(printed)["generated_ids"] == out[0, len(ids):].tolist()


def test_generate_with_edit_options_is_the_plain_generation_of_the_edited_model(capsys):
    """--steer, --route-around, --ablate and --swap make their edits at every step: the text and the routing are
    those of transformers' own generate with layer 1's router logits biased and expert 6 left out (F.linear's output
    for that router's weight, patched), expert 2's weights zeroed and expert 4's slots run by expert 0 (forward pre-hook
    on the experts)."""
    from unittest import mock

    from test_generation_routing import expected_routing, plain_generation

    reference = moelens.load()
    module = reference._module
    ids = reference.tokenizer("def mean(values):", add_special_tokens=False)["input_ids"]
    router = module.model.layers[1].mlp.gate.weight
    linear = torch.nn.functional.linear

    def steered(x, weight, bias=None):
        out = linear(x, weight, bias)
        if weight is not router:
            return out
        out = out.clone()
        out[..., 5] += 3.0
        out[..., 6] = float("-inf")
        return out

    def zeroed_and_swapped(experts, args):
        indices, weights = args[1], args[2]
        return args[0], torch.where(indices == 4, 0, indices), weights.masked_fill(indices == 2, 0), *args[3:]

    hook = module.model.layers[1].mlp.experts.register_forward_pre_hook(zeroed_and_swapped)
    try:
        with mock.patch.object(torch.nn.functional, "linear", steered):
            out, _, calls, _ = plain_generation(module, [ids], 0)  # NEW = 6 tokens, greedy
    finally:
        hook.remove()
    status, printed, err = run(["generate", "tiny", "--prompt", "def mean(values):", "--max-new-tokens", 6,
                                "--layers", 1, "--json", "--steer", "1:5=3", "--route-around", "1:6", "--ablate", "1:2",
                                "--swap", "1:4=0"], capsys)
    assert status == 0, err
    report = json.loads(printed)
    assert report["generated_ids"] == out[0, len(ids):].tolist()
    indices, weights = expected_routing(calls["model.layers.1.mlp.experts"], [ids], len(ids), [6])
    assert not (indices == 6).any() and not (indices == 4).any() and (indices == 2).any()
    order = torch.argsort(weights, dim=-1, descending=True, stable=True)
    assert report["experts"][0] == indices.gather(-1, order).tolist()
    for argv, message in [(["--steer", "9:5=3"], r"--steer 9:\.\.\.: layer 9 has no MoE block; the layers of one MoE "
                                                 r"block are \[0, 1, 2, 3\]\."),
                          (["--ablate", "1:99"], r"--ablate of layer 1: experts \[99\] out of range: layer 1's MoE "
                                                 r"block has 8 experts"),
                          # an uncaught IndexError; a negative id swapped expert 7; a swap to itself did nothing
                          (["--swap", "1:99=0"], r"--swap of layer 1: experts \[99\] out of range"),
                          (["--swap", "1:-1=0"], r"--swap of layer 1: experts \[-1\] out of range"),
                          (["--swap", "1:4=4"], r"--swap of layer 1: experts \[4\] are swapped to themselves"),
                          (["--ablate", "1:2", "--swap", "1:2=0"], r"--ablate of layer 1 and --swap of layer 1 both "
                                                                  r"name experts \[2\]"),
                          # refused naming every expert routed around (it named the last)
                          (["--route-around", "1:0,1,2,3,4,5,6,7"], r"ablate\(mode='route_around'\) of experts "
                                                                    r"\[0, 1, 2, 3, 4, 5, 6, 7\]: .*route_around fewer"),
                          (["--swap", "1:3"], r"--swap '1:3': expected LAYER:EXPERT=TO")]:
        status, _, err = run(["generate", "tiny", "--prompt", "x", "--max-new-tokens", 2, *argv], capsys)
        assert status == 2 and re.search(message, err) and "Traceback" not in err, err


@pytest.mark.parametrize(("argv", "message"), [
    (["--layers", 9], r"layers \[9\] are not MoE layers; the MoE layers are \[0, 1, 2, 3\]"),
    (["--max-new-tokens", 0], r"--max-new-tokens must be an integer of at least 1, got 0"),
    (["--threads", 0], r"--threads must be at least 1, got 0"),
    (["--layers", 0, 0], r"--layers names a layer more than once \(0 0\); give each once"),
    (["--prompt", ""], r"the prompt has no tokens \(the tokenizer made none of it\); give it at least one"),
])
def test_generate_refuses_bad_options_in_one_line(argv, message, capsys):
    status, out, err = run(["generate", "tiny", "--prompt", "x", *argv], capsys)
    assert status == 2 and re.search(message, err) and "Traceback" not in err, err


@pytest.mark.parametrize("missing", [("torch_to_nnef",), ("tract",), ("torch_to_nnef", "tract")])
def test_export_without_the_export_extra_names_it_before_the_model_loads(monkeypatch, tmp_path, capsys, missing):
    """Without torch-to-nnef or tract, `moelens export` loaded the model and copied it before naming the extra."""
    import moelens.export.cli as export_cli

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded although the export extra is missing")

    for name in missing:
        monkeypatch.setitem(sys.modules, name, None)  # find_spec answers None, import raises ImportError
    monkeypatch.setattr(export_cli, "load_checkpoint", never)
    status, out, err = run(["export", "tiny", tmp_path / "x.nnef.tgz", "--no-verify"], capsys)
    assert status == 2 and "NNEF export needs the export extra (" in err and "pip install 'moelens[export]'" in err, err
    assert not (tmp_path / "x.nnef.tgz").exists()
