"""Contracts of the expert logit lens, token strings and routing plots, against independent truths.

The logit lens is recomputed from a plain nnsight trace of an unwrapped copy (each experts call's raw
arguments, one corpus item at a time, no padding), the experts' weights, and the final norm and unembedding
applied by hand (RMSNorm written out, ``@ lm_head.weight.T``). Plots are read back from the returned figure's
artists (image arrays, line data, bar sizes, texts, tick labels, titles) and compared with numbers computed
by hand from the result objects' raw counts, never with another moelens computation.
"""

from __future__ import annotations

import copy
import math

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

import moelens  # noqa: E402
from groundtruth import expert_forward, raw_values  # noqa: E402
from moelens import analysis  # noqa: E402
from moelens.analysis.cache import SKIPPED  # noqa: E402
from moelens.analysis.coactivation import Coactivation, Transitions  # noqa: E402
from moelens.analysis.entropy import Entropy  # noqa: E402
from moelens.analysis.logit_lens import ExpertLens  # noqa: E402
from moelens.analysis.specialisation import Specialisation  # noqa: E402
from moelens.analysis.token_view import TokenRouting  # noqa: E402
from moelens.analysis.top_tokens import ExpertTokens  # noqa: E402
from moelens.analysis.usage import LoadBalance, Usage  # noqa: E402
from moelens.errors import MoelensError  # noqa: E402
from moelens.testing import tiny_model  # noqa: E402

plots = analysis.plots


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plots.pyplot().close("all")


def image(axes) -> torch.Tensor:
    """The array an axes' first image draws, masked cells as NaN."""
    array = axes.images[0].get_array()
    filled = array.filled(float("nan")) if hasattr(array, "filled") else array
    return torch.as_tensor(filled, dtype=torch.float64)


def panels(figure) -> list:
    """The figure's grid panels (not its colour bars), in reading order."""
    return [axes for axes in figure.axes if axes.get_label() != "<colorbar>"]


def labels(ticks) -> list[str]:
    return [tick.get_text() for tick in ticks]


# -- the expert logit lens, by hand ------------------------------------------------------------------


def lens_by_hand(reference, wrapped, corpus):
    """Per MoE block: (sum of each expert's weighted outputs, slot counts), from raw experts-call arguments."""
    names = [moe.path.removeprefix("model.") for moe in wrapped.moes]
    sums = {name: torch.zeros(8, reference.config.hidden_size, dtype=torch.float64) for name in names}
    counts = {name: torch.zeros(8, dtype=torch.int64) for name in names}
    with torch.no_grad():
        for ids in corpus:
            raw = raw_values(reference, {"input_ids": torch.tensor([ids])}, names, wrapped.family)
            for name in names:
                hidden, chosen, weights = raw[name].routing
                hidden, chosen, weights = (value.reshape(len(ids), -1) for value in (hidden, chosen, weights))
                experts = reference.get_submodule(f"{name}.{wrapped.family.experts}")
                for token in range(len(ids)):
                    for slot in range(chosen.shape[1]):
                        expert = int(chosen[token, slot])
                        _, out = expert_forward(experts, hidden[token : token + 1], expert)
                        sums[name][expert] += out[0].double() * float(weights[token, slot])
                        counts[name][expert] += 1
    return names, sums, counts


def read_out(reference, vectors: torch.Tensor) -> torch.Tensor:
    """lm_head(final RMSNorm(v)), the norm written out from its weight and epsilon."""
    norm = reference.model.norm
    v = vectors.double()
    normed = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight.double()
    return (normed @ reference.lm_head.weight.double().T).float()


@pytest.fixture(scope="module")
def qwen_lens():
    hf = tiny_model("qwen2_moe")
    torch.manual_seed(11)
    with torch.no_grad():  # a trained norm is not all ones: dropping it changes the ranking, not only the scale
        hf.model.norm.weight.uniform_(0.1, 3.0)
    reference = copy.deepcopy(hf)
    return hf, reference, moelens.wrap(hf)


def test_logit_lens_matches_a_readout_by_hand_over_padded_batches(qwen_lens):
    """Items of different lengths, two per batch (padding) over several batches; few enough tokens that some
    experts are never reached. Counts, means, top ids and top logits all follow the by-hand readout; an expert
    no token reached has a zero mean (never NaN), -inf logits and no tokens; ``top`` above the vocabulary
    returns the whole vocabulary."""
    hf, reference, wrapped = qwen_lens
    corpus = [[5, 17, 42], [9], [88, 3]]
    vocab = hf.config.vocab_size
    lens = analysis.expert_logit_lens(wrapped, corpus, top=vocab + 7, batch_size=2, progress=False)
    names, sums, counts = lens_by_hand(reference, wrapped, corpus)
    assert lens.top_ids.shape[-1] == vocab and lens.norm == "model.norm"
    unreached = 0
    for row, name in enumerate(names):
        assert lens.counts[row].tolist() == counts[name].tolist(), row
        means = sums[name] / counts[name].clamp(min=1)[:, None]
        torch.testing.assert_close(lens.mean_outputs[row].double(), means, atol=1e-5, rtol=1e-4)
        logits = read_out(reference, means)
        for expert in range(8):
            if counts[name][expert]:
                expected = logits[expert].topk(vocab)
                assert lens.top_ids[row, expert, :5].tolist() == expected.indices[:5].tolist(), (row, expert)
                torch.testing.assert_close(lens.top_logits[row, expert], expected.values, atol=1e-4, rtol=1e-4)
                assert lens.tokens[row][expert] == [f"#{i}" for i in lens.top_ids[row, expert].tolist()]
            else:
                unreached += 1
                assert (lens.mean_outputs[row, expert] == 0).all(), (row, expert)
                assert torch.isneginf(lens.top_logits[row, expert]).all(), (row, expert)
                assert lens.tokens[row][expert] == [] and lens.promoted(wrapped.moes[row].layer, expert) == []
    assert unreached  # the corpus is short enough that some expert of some layer got no token


def test_relative_lens_keeps_the_plain_means_and_ignores_unreached_experts(qwen_lens):
    """relative=True subtracts the count-weighted layer mean before the readout; ``mean_outputs`` stays each
    expert's own mean (the documented attribute), and an unreached expert does not poison the layer mean."""
    hf, reference, wrapped = qwen_lens
    corpus = [[5, 17, 42, 9], [88, 3]]
    lens = analysis.expert_logit_lens(wrapped, corpus, top=4, relative=True, batch_size=1, progress=False)
    names, sums, counts = lens_by_hand(reference, wrapped, corpus)
    assert lens.relative
    for row, name in enumerate(names):
        means = sums[name] / counts[name].clamp(min=1)[:, None]
        torch.testing.assert_close(lens.mean_outputs[row].double(), means, atol=1e-5, rtol=1e-4)
        logits = read_out(reference, means - sums[name].sum(0) / counts[name].sum())
        reached = torch.nonzero(counts[name]).flatten().tolist()
        assert len(reached) < 8 or row > 0  # at least the first layer leaves an expert unreached
        for expert in reached:
            expected = logits[expert].topk(4)
            assert lens.top_ids[row, expert].tolist() == expected.indices.tolist(), (row, expert)
            torch.testing.assert_close(lens.top_logits[row, expert], expected.values, atol=1e-4, rtol=1e-4)


def test_the_lens_averages_only_the_slots_that_ran_an_expert():
    """zaya's router can send a slot to a skip class that runs no expert: the lens counts the slots a routing
    cache counts (the non-skipped ones) and its means are over those slots only."""
    hf = tiny_model("zaya")
    wrapped = moelens.wrap(hf)
    corpus = [list(range(5, 29))]
    cache = analysis.collect_routing(wrapped, corpus, progress=False)
    lens = analysis.expert_logit_lens(wrapped, corpus, progress=False)
    skipped = 0
    for row, layer in enumerate(cache.layers):
        indices = cache.indices(layer).long().flatten()
        skipped += int((indices == SKIPPED).sum())
        ran = indices[indices != SKIPPED]
        expected = [int((ran == expert).sum()) for expert in range(lens.counts.shape[1])]
        assert lens.counts[row].tolist() == expected, layer
    assert skipped  # the corpus routes some slots to the skip class


def lens_beside_plain(hf):
    """(an untouched copy of ``hf``, ``hf`` wrapped, a corpus of one text, the wrapped model's lens over it, plain
    nnsight over the copy)."""
    import nnsight

    reference = copy.deepcopy(hf)
    wrapped = moelens.wrap(hf)
    corpus = [list(range(3, 15))]
    return reference, wrapped, corpus, analysis.expert_logit_lens(wrapped, corpus, progress=False), nnsight.NNsight(reference)


def test_latent_experts_are_projected_without_the_projections_bias():
    """nemotron_h with a latent space and biased projections: the block adds fc2_latent_proj's bias once per
    token to the routed sum, so the per-expert readout is the latent mean times the weight only. Truth: what a
    plain nnsight trace sees entering fc2_latent_proj, summed over tokens, times its weight."""
    reference, wrapped, corpus, lens, plain = lens_beside_plain(tiny_model("nemotron_h", moe_latent_size=16, mlp_bias=True))
    for row, moe in enumerate(wrapped.moes):
        projection = reference.get_submodule(moe.path.removeprefix("model.")).fc2_latent_proj
        assert projection.bias is not None and projection.bias.abs().sum() > 0
        with torch.no_grad(), plain.trace(torch.tensor(corpus)):
            latent = plain.get(moe.path.removeprefix("model.")).fc2_latent_proj.input.save()
        total = latent.reshape(-1, 16).double().sum(0) @ projection.weight.detach().double().T
        by_expert = (lens.mean_outputs[row].double() * lens.counts[row, :, None]).sum(0)
        torch.testing.assert_close(by_expert, total, atol=1e-4, rtol=1e-4)


def test_experts_without_a_latent_space_are_read_as_they_are():
    """nemotron_h without moe_latent_size has an Identity fc2_latent_proj: the lens reads the experts' outputs
    unchanged (an Identity has no weight to apply, and needs none). Truth: the experts call's output in a plain
    nnsight trace, summed over the tokens."""
    reference, wrapped, corpus, lens, plain = lens_beside_plain(tiny_model("nemotron_h"))
    for row, moe in enumerate(wrapped.moes):
        block = moe.path.removeprefix("model.")
        assert isinstance(reference.get_submodule(block).fc2_latent_proj, torch.nn.Identity)
        with torch.no_grad(), plain.trace(torch.tensor(corpus)):
            routed = plain.get(block).experts.output.save()
        by_expert = (lens.mean_outputs[row].double() * lens.counts[row, :, None]).sum(0)
        torch.testing.assert_close(by_expert, routed.reshape(-1, reference.config.hidden_size).double().sum(0),
                                   atol=1e-4, rtol=1e-4)


# -- token strings ------------------------------------------------------------------------------------


def test_token_strings_keep_a_sentencepiece_word_start_apart_from_a_piece_inside_a_word():
    """A Llama / Mixtral tokenizer (SentencePiece, "▁" word marker) drops the leading space of what it decodes: each
    id decoded alone, "▁the" (a word start) and "the" (inside "bathe") both showed as "the" in tables and plots.
    Truth: the tokenizer's own pieces, "▁" shown as the middle dot that stands for a space."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", "▁the", "the", "▁", "▁other", "▁ba", "▁a", "a", "e", "h", "t", "r", "o", "b"]
    unigram = Tokenizer(models.Unigram([(piece, -float(len(pieces) - len(piece))) for piece in pieces], unk_id=0))
    unigram.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    unigram.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])  # as transformers converts Llama's
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=unigram, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    ids = tokenizer("the other bathe", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert tokenizer.decode(ids[:1]) == tokenizer.decode(ids[3:4]) == "the"  # what each id decoded alone gave
    expected = [piece.replace("▁", "\u00b7") for piece in tokenizer.convert_ids_to_tokens(ids)]
    assert analysis.text.token_strings(tokenizer, ids) == expected == ["\u00b7the", "\u00b7other", "\u00b7ba", "the",
                                                                       "</s>"]


def test_token_strings_show_the_bytes_of_a_token_that_holds_part_of_a_character():
    """Decoded alone, a token holding part of a character's UTF-8 bytes is U+FFFD: every CJK token of moelens-tiny
    (byte-level BPE) showed as the same "\ufffd" in tables and plots. Truth: the text's own UTF-8 bytes, which the
    shown tokens spell (whole characters as themselves, the parts as \\x escapes)."""
    from transformers import AutoTokenizer

    from moelens.data import TINY_MODEL_PATH

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_PATH)
    text = "中文 é, x"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert "\ufffd" in tokenizer.decode(ids[:1])  # what each id decoded alone gave
    shown = analysis.text.token_strings(tokenizer, ids)
    spelt = "".join(shown).replace("\u00b7", " ").encode("latin-1", errors="backslashreplace")
    assert spelt.decode("unicode_escape").encode("latin-1") == text.encode("utf-8")
    assert len(set(shown[:6])) == 6  # the six bytes of 中文, told apart


def test_token_strings_show_a_sentencepiece_byte_piece_as_its_byte():
    """SentencePiece's byte fallback (<0xE4>) decoded alone is U+FFFD too; a tokenizer with no byte pieces shows
    the id beside it."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "a", "<0xE4>", "<0xB8>", "<0xAD>"]
    unigram = Tokenizer(models.Unigram([(piece, -1.0) for piece in pieces], unk_id=0, byte_fallback=True))
    unigram.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=unigram, unk_token="<unk>")
    assert tokenizer.decode([2]) == "\ufffd" and tokenizer.decode([2, 3, 4]) == "中"
    assert analysis.text.token_strings(tokenizer, [1, 2, 3, 4]) == ["a", "\\xe4", "\\xb8", "\\xad"]

    class Decoder:
        def decode(self, ids):
            return "\ufffd"

    assert analysis.text.token_strings(Decoder(), [9]) == ["\ufffd#9"]


def test_token_strings_decode_each_id_alone_and_fall_back_to_ids():
    class Decoder:
        def decode(self, ids, **kwargs):
            assert isinstance(ids, list) and len(ids) == 1 and not kwargs
            return {1: "<s>", 2: " a", 3: "\t", 4: "\x00", 5: ""}[ids[0]]

    assert analysis.text.token_strings(Decoder(), [1, 2, 3, 4, 5]) == ["<s>", "\u00b7a", "\\t", "\\x00", "\u2205"]
    assert analysis.text.token_strings(None, torch.tensor([7, 0])) == ["#7", "#0"]
    # only control characters (category Cc) are escaped: a no-break space or a joiner is text, not a control
    assert analysis.text.display("a\u00a0b\u200d\x85") == "a\u00a0b\u200d\\x85"
    analysis.text.check_tokenizer(None)  # None: ids shown as #<id>
    with pytest.raises(MoelensError, match="tokenizer must be a tokenizer with a decode method"):
        analysis.text.check_tokenizer(object())


# -- plots, read back ---------------------------------------------------------------------------------


def test_usage_plot_draws_each_layers_shares_labelled_by_layer():
    counts = torch.tensor([[6, 2, 0, 0], [1, 1, 1, 5]])
    usage = Usage(layers=[3, 7], counts=counts, weight=torch.zeros(2, 4, dtype=torch.float64), tokens=4,
                  top_k=[2, 2], num_experts=[2, 4])
    figure = plots.plot_usage(usage)
    axes = figure.axes[0]
    expected = torch.tensor([[6 / 8, 2 / 8, math.nan, math.nan], [1 / 8, 1 / 8, 1 / 8, 5 / 8]], dtype=torch.float64)
    torch.testing.assert_close(image(axes), expected, equal_nan=True)
    assert labels(axes.get_yticklabels()) == ["3", "7"]
    assert axes.images[0].get_clim()[0] == 0
    assert [text.get_text() for text in axes.texts] == ["75", "25", "12", "12", "12", "62"]  # percent, rounded
    assert "4 tokens" in axes.get_title() and "annotations in %" in axes.get_title()
    # more experts than cells get labels, few layers: no labels at all (not 4 x 20 numbers in tiny cells)
    wide = Usage(layers=[0, 1], counts=torch.ones(2, 20, dtype=torch.int64), weight=torch.zeros(2, 20, dtype=torch.float64),
                 tokens=10, top_k=[2, 2])
    figure = plots.plot_usage(wide)
    assert not figure.axes[0].texts and "annotations" not in figure.axes[0].get_title()


def test_load_balance_plot_draws_cv_left_and_max_over_mean_right():
    balance = LoadBalance(layers=[1, 5], cv=torch.tensor([0.25, 0.5]), max_over_mean=torch.tensor([1.5, 3.0]),
                          min_over_mean=torch.tensor([0.5, 0.0]), entropy=torch.tensor([0.9, 0.6]),
                          unused=torch.tensor([0, 1]))
    left, right = plots.plot_load_balance(balance).axes
    assert [bar.get_height() for bar in left.patches] == pytest.approx([0.25, 0.5])
    assert [bar.get_height() for bar in right.patches] == pytest.approx([1.5, 3.0])
    assert "variation" in left.get_title() and "max / mean" in right.get_title()


def test_entropy_plot_draws_each_layers_own_density_across_its_bins():
    histogram = torch.tensor([[1, 3, 0, 4], [10, 0, 0, 0]])
    entropy = Entropy(layers=[2, 6], source="router", mean=torch.tensor([0.6, 0.1]), histogram=histogram,
                      edges=torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0]), tokens=10)
    axes = plots.plot_entropy(entropy).axes[0]
    assert len(axes.lines) == 2
    for line, row in zip(axes.lines, ([1 / 8, 3 / 8, 0, 4 / 8], [1.0, 0, 0, 0])):  # steps from edge to edge
        assert list(line.get_xdata()) == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
        assert list(line.get_ydata()) == pytest.approx(row + row[-1:]) and line.get_drawstyle() == "steps-post"
    assert labels(axes.get_legend().get_texts()) == ["layer 2 (mean 0.60)", "layer 6 (mean 0.10)"]
    assert axes.get_xlim() == (0, 1)
    # up to LEGEND_LAYERS layers keep a legend; one more gets the colour scale by layer and a panel of means
    layers = list(range(10, 10 + plots.LEGEND_LAYERS + 1))
    many = Entropy(layers=layers, source="weights", mean=torch.linspace(0, 1, len(layers)),
                   histogram=torch.ones(len(layers), 4, dtype=torch.int64), edges=entropy.edges, tokens=4)
    few = Entropy(layers=layers[:-1], source="weights", mean=many.mean[:-1], histogram=many.histogram[:-1],
                  edges=entropy.edges, tokens=4)
    assert len(plots.plot_entropy(few).axes[0].get_legend().get_texts()) == plots.LEGEND_LAYERS
    figure = plots.plot_entropy(many)
    curves = figure.axes[0]
    assert curves.get_legend() is None
    viridis = matplotlib.colormaps["viridis"]
    first, last = (matplotlib.colors.to_rgba(curves.lines[i].get_color()) for i in (0, -1))
    assert first == pytest.approx(viridis(0.0)) and last == pytest.approx(viridis(1.0))  # the scale spans the layers


def test_coactivation_plot_leaves_the_diagonal_blank():
    counts = torch.tensor([[4, 1, 3], [1, 2, 0], [3, 0, 5]])
    axes = plots.plot_coactivation(Coactivation(layer=1, counts=counts, tokens=6)).axes[0]
    drawn = image(axes)
    assert torch.isnan(drawn.diagonal()).all()  # P(i | i) = 1 would set the colour scale
    for i in range(3):
        for j in range(3):
            if i != j:
                assert float(drawn[i, j]) == pytest.approx(int(counts[i, j]) / int(counts[i, i]))
    assert axes.get_title() == "layer 1"


def test_transition_plot_names_source_rows_and_target_columns():
    counts = torch.tensor([[1, 1, 0], [0, 0, 3]])  # no cell reaches 1: the colour scale must still end at 1
    item = Transitions(source=1, target=3, counts=counts, slots="top1", tokens=6, sources=torch.tensor([2, 4]))
    axes = plots.plot_transitions(item).axes[0]
    torch.testing.assert_close(image(axes), torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 0.75]], dtype=torch.float64))
    assert axes.get_title() == "layer 1 -> 3"
    assert axes.get_ylabel() == "expert in layer 1" and axes.get_xlabel() == "expert in layer 3"
    assert axes.images[0].get_clim() == (0, 1)  # a probability: the colour scale is [0, 1] whatever the data


def test_token_routing_plot_cells_name_each_tokens_top_two_experts_and_cut_at_max_tokens():
    indices = torch.tensor([[[3, 1, 0], [2, 0, 1], [SKIPPED, SKIPPED, SKIPPED], [1, 3, 2]],
                            [[0, 2, 1], [1, 2, 3], [3, 0, 2], [2, 1, 0]]])
    view = TokenRouting(token_ids=torch.tensor([10, 11, 12, 13]), tokens=["a", "b", "c", "d"], layers=[0, 4],
                        indices=indices, weights=torch.ones(2, 4, 3), num_experts=[4, 4])
    figure = plots.plot_token_routing(view, max_tokens=3)
    axes = figure.axes[0]
    assert image(axes).tolist() == [[3, 2, -1], [0, 1, 3]]  # the first 3 tokens' highest-weighted experts
    assert [text.get_text() for text in axes.texts] == ["3\n1", "2\n0", "skip\nskip", "0\n2", "1\n2", "3\n0"]
    assert labels(axes.get_xticklabels()) == ["a", "b", "c"]
    assert labels(axes.get_yticklabels()) == ["layer 0", "layer 4"]
    assert "(first 3 of 4 tokens)" in axes.get_title()


def test_top_tokens_plot_annotates_the_other_value_best_first():
    item = ExpertTokens(layer=2, expert=5, token_ids=torch.tensor([40, 41]), counts=torch.tensor([9, 4]),
                        share=torch.tensor([0.75, 0.5]), tokens=["x", "y"], total=13)
    for value, bars, notes in (("counts", [9, 4], [" 75%", " 50%"]), ("share", [0.75, 0.5], [" 9", " 4"])):
        axes = plots.plot_top_tokens([item], value=value).axes[0]
        assert [bar.get_width() for bar in axes.patches] == pytest.approx(bars)
        assert [text.get_text() for text in axes.texts] == notes
        assert labels(axes.get_yticklabels()) == ["x", "y"]
        assert axes.yaxis_inverted()  # the most served token on top
        assert axes.get_title() == "layer 2 expert 5"


def hand_lens(relative: bool = False) -> ExpertLens:
    """Two layers (1 and 4) of 3 experts; expert 1 of layer 4 got no token."""
    top_logits = torch.tensor([[[5.0, 4.0, 0.0], [3.0, 2.0, 1.0], [9.0, 8.0, 4.0]],
                               [[7.0, 6.0, 2.0], [-math.inf] * 3, [1.0, 0.5, 0.0]]])
    tokens = [[["a0", "a1", "a2"], ["b0", "b1", "b2"], ["c0", "c1", "c2"]],
              [["d0", "d1", "d2"], [], ["f0", "f1", "f2"]]]
    return ExpertLens(layers=[1, 4], counts=torch.tensor([[2, 3, 1], [4, 0, 2]]), mean_outputs=torch.zeros(2, 3, 2),
                      top_ids=torch.zeros(2, 3, 3, dtype=torch.int64), top_logits=top_logits, tokens=tokens,
                      relative=relative, norm=None, num_experts=[3, 3])


def test_logit_lens_plot_draws_the_last_layers_reached_experts_centred_per_row():
    axes = plots.plot_logit_lens(hand_lens()).axes[0]  # default: the last layer
    assert "layer 4" in axes.get_title() and "mean output" in axes.get_title()
    torch.testing.assert_close(image(axes), torch.tensor([[2.0, 1.0, -3.0], [0.5, 0.0, -0.5]], dtype=torch.float64))
    assert [text.get_text() for text in axes.texts] == ["d0", "d1", "d2", "f0", "f1", "f2"]
    assert labels(axes.get_yticklabels()) == ["e0 (4)", "e2 (2)"]
    assert labels(axes.get_xticklabels()) == ["#1", "#2", "#3"]
    axes = plots.plot_logit_lens(hand_lens(relative=True), layer=1, top=2).axes[0]
    assert "layer 1" in axes.get_title() and "relative to the layer mean" in axes.get_title()
    torch.testing.assert_close(image(axes), torch.tensor([[0.5, -0.5]] * 3, dtype=torch.float64))
    assert [text.get_text() for text in axes.texts] == ["a0", "a1", "b0", "b1", "c0", "c1"]
    assert labels(axes.get_yticklabels()) == ["e0 (2)", "e1 (3)", "e2 (1)"]


def test_specialisation_plot_draws_each_layer_and_blanks_unused_experts():
    counts = torch.tensor([[[3, 1], [0, 0], [1, 3]], [[2, 0], [0, 2], [1, 1]]])
    spec = Specialisation(layers=[0, 2], classes=["code", "prose"], counts=counts)
    figure = plots.plot_specialisation(spec, value="share")
    for panel, (axes, layer) in enumerate(zip(panels(figure), spec.layers)):
        drawn = image(axes)
        for expert in range(3):
            total = int(counts[panel, expert].sum())
            row = drawn[expert].tolist()
            if total:
                assert row == pytest.approx([int(counts[panel, expert, c]) / total for c in range(2)])
            else:
                assert all(math.isnan(value) for value in row)
        assert axes.get_title() == f"layer {layer}"
        assert labels(axes.get_xticklabels()) == ["code", "prose"]


def test_panel_grids_wrap_at_four_columns_and_hide_the_spare_panels():
    pair = torch.tensor([[2, 1], [1, 2]])
    items = [Coactivation(layer=layer, counts=pair, tokens=3) for layer in range(5)]
    figure = plots.plot_coactivation(items)
    grid = panels(figure)
    assert len(grid) == 8  # 2 rows x 4 columns
    shown = [axes for axes in grid if axes.axison]
    assert [axes.get_title() for axes in shown] == [f"layer {layer}" for layer in range(5)]
    assert len(shown) == 5


@pytest.mark.parametrize("bad", [None, 1.5, ["x.png"]], ids=["none", "float", "list"])
def test_a_path_that_is_no_path_is_refused_naming_the_argument_and_the_figure_is_closed(bad, tmp_path):
    """Every path argument gave pathlib's bare TypeError ("expected str, bytes or os.PathLike object"), and
    plots.save left the figure open though it promises to close it, written or not."""
    from matplotlib import pyplot

    from moelens.analysis import plots
    from moelens.analysis.cache import RoutingCache

    figure = pyplot.figure()
    with pytest.raises(MoelensError, match=rf"path must be a path \(a str or a pathlib.Path\), got {type(bad).__name__}"):
        plots.save(figure, bad)
    assert not pyplot.fignum_exists(figure.number)
    for dpi in (1.5, True, "x", 10**6):
        figure = pyplot.figure()
        with pytest.raises(MoelensError, match=r"save: dpi must be a number of dots per inch from 10 to 2000"):
            plots.save(figure, tmp_path / "dpi.png", dpi=dpi)
        assert not pyplot.fignum_exists(figure.number)
    with pytest.raises(MoelensError, match=r"save: figure must be a matplotlib Figure .* got NoneType"):
        plots.save(None, tmp_path / "none.png")
    with pytest.raises(MoelensError, match=r"RoutingCache.load's folder must be a path"):
        RoutingCache.load(bad)
    assert list(tmp_path.iterdir()) == []


def test_save_writes_at_the_dpi_asked(tmp_path):
    """Four times the dpi is four times the pixels each way (the dpi could be dropped for the default unseen; the
    tight bounding box pads the 2 x 1 inch figure by 0.1 inch a side)."""
    import struct

    from matplotlib import pyplot
    from moelens.analysis import plots

    sizes = []
    for dpi in (50, 200):
        figure = pyplot.figure(figsize=(2, 1))
        header = plots.save(figure, tmp_path / f"at-{dpi}.png", dpi=dpi).read_bytes()[16:24]
        sizes.append(struct.unpack(">II", header))  # the PNG's IHDR width and height
    assert sizes == [(110, 60), (440, 240)]


def dollar_tokenizer():
    """A word-level tokenizer of 128 words where "$$", "$x$" and most others hold a pair of dollar signs (as LaTeX
    vocabularies do), so every plot of tokens has some; the text's words are its tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<unk>", "$$", "$x$", "x", "=", "1"]
    words += [f"${i}$" for i in range(128 - len(words))]
    model = Tokenizer(models.WordLevel(vocab={word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=model, pad_token="<pad>", unk_token="<unk>")


def drawn_texts(figure, texts) -> list:
    """``texts(axes)`` of each panel after the figure is drawn and written as a PNG (where mathtext parses labels)."""
    import io

    figure.savefig(io.BytesIO(), format="png")
    return [text for axes in panels(figure) for text in texts(axes)]


def test_token_plots_draw_tokens_holding_dollar_signs_as_their_text():
    """Tokens went to matplotlib as labels with math parsing on: a token "$$" raised ParseException when the plot was
    drawn or saved, and "$x$" was drawn as an italic x, not as the token. Truth: the text's own words (the word-level
    tokenizer makes one token of each) and, for the lens, the tokens the result names."""
    text = "$$ x = 1 $$ $x$ = 1"
    model = moelens.wrap(tiny_model("qwen2_moe"), tokenizer=dollar_tokenizer())
    view = analysis.token_routing(model, text)
    assert view.tokens == text.split()
    labels_drawn = drawn_texts(plots.plot_token_routing(view), lambda axes: axes.get_xticklabels())
    assert [label.get_text() for label in labels_drawn] == text.split()
    assert not any(label.get_parse_math() for label in labels_drawn)

    cache = analysis.collect_routing(model, [text] * 2, progress=False)
    experts = analysis.top_tokens(cache, cache.layers[0], n=4, min_count=1, tokenizer=model.tokenizer)
    labels_drawn = drawn_texts(plots.plot_top_tokens(experts), lambda axes: axes.get_yticklabels())
    assert [label.get_text() for label in labels_drawn] == [token for item in experts for token in item.tokens]
    assert {"$$", "$x$"} <= {label.get_text() for label in labels_drawn} <= set(text.split())
    assert not any(label.get_parse_math() for label in labels_drawn)

    lens = analysis.expert_logit_lens(model, [text], top=3, progress=False)
    row = len(lens.layers) - 1
    reached = [e for e in range(lens.counts.shape[1]) if int(lens.counts[row, e]) > 0]
    cells = drawn_texts(plots.plot_logit_lens(lens, top=3), lambda axes: axes.texts)
    assert [cell.get_text() for cell in cells] == [token[:10] for e in reached for token in lens.tokens[row][e][:3]]
    assert any(cell.get_text().count("$") >= 2 for cell in cells)
    assert not any(cell.get_parse_math() for cell in cells)


def test_plot_specialisation_draws_class_names_holding_dollar_signs_as_their_text():
    """Class names went to matplotlib as tick labels with math parsing on: "$\\foo$" raised ParseFatalException when
    the plot was laid out and "$5 to $10" was drawn as italic math. Truth: the class names given."""
    classes = ["$\\foo$", "$5 to $10", "a_b"]
    spec = Specialisation([0], classes, torch.tensor([[[3, 1, 0], [1, 2, 4]]]))
    labels_drawn = drawn_texts(plots.plot_specialisation(spec), lambda axes: axes.get_xticklabels())
    assert [label.get_text() for label in labels_drawn] == classes
    assert not any(label.get_parse_math() for label in labels_drawn)


def test_plot_risk_difference_draws_class_names_holding_dollar_signs_as_their_text():
    """The title and colour-bar label name the classes: "$HOME" and "$PATH" were drawn as italic math and "a_$x^$"
    raised ValueError when the figure was drawn. Truth: the class names given."""
    classes = ["a_$x^$", "$HOME"]
    spec = Specialisation([0], classes, torch.tensor([[[3, 1], [1, 2]]]), tokens=torch.tensor([[2, 2]]),
                          reached=torch.tensor([[[2, 1], [1, 2]]]))
    import io

    figure = plots.plot_risk_difference(spec, 0, 1)
    figure.savefig(io.BytesIO(), format="png")  # where mathtext parses them
    heatmap, bar = figure.axes
    drawn = [heatmap.title, bar.yaxis.label]
    plots.pyplot().close(figure)
    assert [text.get_text() for text in drawn] == ["Risk difference: a_$x^$ minus $HOME",
                                                   "P(expert | a_$x^$) - P(expert | $HOME)"]
    assert not any(text.get_parse_math() for text in drawn)


def test_save_takes_a_numpy_or_tensor_dpi_as_matplotlib_does_and_refuses_a_bool(tmp_path):
    """plots.save refused dpi=np.int64(200), np.float32(200) and torch.tensor(200) (which matplotlib's savefig takes)
    as not "a number of dots per inch from 10 to 2000". Truth: the PNG is 2.2 x 1.2 inches (a 2 x 1 figure, the tight
    box's 0.1 inch pad a side) at 200 dots per inch."""
    import struct

    import numpy as np
    from matplotlib import pyplot

    for number, dpi in enumerate((np.int64(200), np.float32(200.0), torch.tensor(200), torch.tensor(200.0))):
        figure = pyplot.figure(figsize=(2, 1))
        header = plots.save(figure, tmp_path / f"at-{number}.png", dpi=dpi).read_bytes()[16:24]
        assert struct.unpack(">II", header) == (440, 240), dpi
    for dpi in (np.bool_(True), torch.tensor(True), np.int64(5), torch.tensor([100, 200])):
        figure = pyplot.figure()
        with pytest.raises(MoelensError, match=r"save: dpi must be a number of dots per inch from 10 to 2000"):
            plots.save(figure, tmp_path / "dpi.png", dpi=dpi)
        assert not pyplot.fignum_exists(figure.number)


def test_a_token_view_and_a_lens_print_as_a_summary_not_every_string():
    """Their dataclass reprs printed every token's string and every expert's promoted tokens (632 KB for a 48-layer,
    128-expert lens), which is what Jupyter shows for a cell's last value."""
    view = TokenRouting(token_ids=torch.arange(500), tokens=[f"tok{i}" for i in range(500)], layers=[0, 4],
                        indices=torch.zeros(2, 500, 3, dtype=torch.int64), weights=torch.ones(2, 500, 3),
                        num_experts=[4, 4])
    assert repr(view) == "TokenRouting(500 tokens, layers [0, 4], top-3 of experts [4, 4]; .table() shows them)"
    assert repr(hand_lens()) == ("ExpertLens(layers [1, 4], experts [3, 3], top 3 tokens each, relative=False, "
                                 "norm=None; .promoted(layer, expert) lists them)")


def test_the_token_plot_takes_max_tokens_none_as_the_table_does():
    """table(max_tokens=None) shows every token; the plot refused None ("an integer of at least 1")."""
    view = TokenRouting(token_ids=torch.arange(70), tokens=[f"t{i}" for i in range(70)], layers=[0],
                        indices=torch.zeros(1, 70, 2, dtype=torch.int64), weights=torch.ones(1, 70, 2), num_experts=[4])
    assert len(plots.plot_token_routing(view, max_tokens=None).axes[0].get_xticklabels()) == 70
    assert view.table(max_tokens=69).splitlines()[-1] == "... 1 more token"


def test_agreement_plot_draws_each_layers_shares_and_the_kept_grid():
    kept = torch.tensor([[1.0, 0.5, float("nan")], [0.0, 1.0, 0.25]], dtype=torch.float64)
    agreement = analysis.Agreement(layers=[2, 7], top1=torch.tensor([0.9, 0.4]), jaccard=torch.tensor([0.8, 0.5]),
                                   same_set=torch.tensor([0.7, 0.2]), kept=kept, tokens=12)
    left, right = plots.plot_agreement(agreement).axes[:2]
    drawn = {line.get_label(): [round(float(y), 6) for y in line.get_ydata()] for line in left.get_lines()}
    assert drawn == {"same top-1 expert": [0.9, 0.4], "mean Jaccard": [0.8, 0.5], "same experts": [0.7, 0.2]}
    assert [tick.get_text() for tick in left.get_xticklabels()] == ["2", "7"]
    grid = right.get_images()[0].get_array()
    assert grid.mask[0, 2] and grid[0, :2].tolist() == [1.0, 0.5]  # matplotlib masks the NaN: a blank cell
    assert grid[1].tolist() == [0.0, 1.0, 0.25] and [tick.get_text() for tick in right.get_yticklabels()] == ["2", "7"]
    assert "12 tokens" in left.figure.texts[0].get_text()
