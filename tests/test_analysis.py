"""Routing analysis against direct computations on small cases.

The ground truth is plain nnsight on an unwrapped copy of the model (the raw
arguments of each experts call and the router's output, one text window at a
time with no padding) and counts done by hand in Python loops; nothing goes
through moelens values, token views or the analysis code.
"""

from __future__ import annotations

import copy
import json
import math
import warnings
from collections import Counter
from dataclasses import dataclass

import nnsight
import pytest
import torch

import moelens
from groundtruth import ascii_tokenizer, expert_forward, raw_values, zero_compute_experts
from moelens import analysis
from moelens.analysis.cache import SKIPPED
from moelens.errors import MoelensError, ValueUnavailable
from moelens.testing import FAMILIES, tiny_model

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "",
    "x = [i * i for i in range(10)]",
    "Routing sends each token to two experts.",
]
MAX_LENGTH = 12  # texts are cut into windows: several per text
WEIGHT_ATOL = 2e-3  # the cache stores weights and logits as float16 by default


@dataclass
class Truth:
    """Per MoE block, everything read with plain nnsight, window by window (no padding)."""

    layers: list[int]
    indices: dict[int, torch.Tensor]  # [T, k]
    weights: dict[int, torch.Tensor]  # [T, k]
    logits: dict[int, torch.Tensor]  # [T, E]
    hidden: dict[int, torch.Tensor]  # [T, D] the experts' input
    token_ids: torch.Tensor
    text_index: torch.Tensor
    position: torch.Tensor


SPECIAL = {0: "<pad>", 1: "<s>", 2: "</s>", 3: "<unk>"}


def shown(token: int) -> str:
    """How the analysis should print an ascii-tokenizer id: its character, made visible."""
    if token < 32:  # not in the vocabulary: decodes to nothing
        return SPECIAL.get(token, "\u2205")
    return analysis.text.display(chr(token))


def test_token_text_shows_control_characters_escaped():
    """Control characters went raw into tables and plot labels (an ESC moves a terminal's cursor; fonts have no
    glyph for them, so matplotlib warned and drew nothing)."""
    display = analysis.text.display
    assert [display(piece) for piece in ("\x06", "a\x1b[0m", "\x7f", "\n\t", " x", "é", "")] == [
        "\\x06", "a\\x1b[0m", "\\x7f", "\\n\\t", "\u00b7x", "é", "\u2205"]


def windows_of(token_lists: list[list[int]], max_length: int):
    for index, ids in enumerate(token_lists):
        for start in range(0, len(ids), max_length):
            yield index, start, ids[start : start + max_length]


def plain_truth(reference: torch.nn.Module, wrapped, token_lists: list[list[int]], max_length: int) -> Truth:
    """Plain-nnsight routing of every window, run alone (batch of one, no padding)."""
    family = wrapped.family
    names = [moe.path.removeprefix("model.") for moe in wrapped.moes]
    layers = [moe.layer for moe in wrapped.moes]
    parts: dict[str, dict[int, list]] = {key: {layer: [] for layer in layers} for key in ("i", "w", "l", "h")}
    ids, texts, positions = [], [], []
    for index, start, window in windows_of(token_lists, max_length):
        inputs = {"input_ids": torch.tensor([window])}
        raw = raw_values(reference, inputs, names, family)
        for layer, name in zip(layers, names):
            value = raw[name]
            logits = value.logits.reshape(len(window), -1)
            parts["l"][layer].append(logits)
            if family.derived_routing:
                top, chosen = torch.topk(logits, wrapped.moes[0].top_k, dim=-1)
                parts["i"][layer].append(chosen)
                parts["w"][layer].append(torch.sigmoid(top))
                parts["h"][layer].append(torch.zeros(len(window), 1))
            else:
                hidden, chosen, weights = value.routing
                parts["i"][layer].append(chosen.reshape(len(window), -1))
                parts["w"][layer].append(weights.reshape(len(window), -1))
                parts["h"][layer].append(hidden.reshape(len(window), -1))
        ids += window
        texts += [index] * len(window)
        positions += list(range(start, start + len(window)))
    cat = lambda key: {layer: torch.cat(parts[key][layer]).cpu() for layer in layers}  # noqa: E731 (a cache is on the CPU)
    return Truth(layers, cat("i"), cat("w"), cat("l"), cat("h"), torch.tensor(ids), torch.tensor(texts),
                 torch.tensor(positions))


@pytest.fixture(scope="module")
def qwen():
    """A tiny Qwen2-MoE with a tokenizer, its cache (several shards) and the plain-nnsight truth."""
    hf = tiny_model("qwen2_moe")
    reference = copy.deepcopy(hf)
    tokenizer = ascii_tokenizer()
    wrapped = moelens.wrap(hf, tokenizer=tokenizer)
    cache = analysis.collect_routing(wrapped, TEXTS, batch_size=3, max_length=MAX_LENGTH, logits=True,
                                     shard_tokens=20, progress=False)
    token_lists = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in TEXTS]
    truth = plain_truth(reference, wrapped, token_lists, MAX_LENGTH)
    return wrapped, hf, cache, truth


def test_empty_items_count_as_texts(qwen):
    wrapped = qwen[0]
    cache = analysis.collect_routing(wrapped, ["x y", "z", "", ""], progress=False)
    assert cache.num_texts == 4 and set(cache.text_index().tolist()) == {0, 1}
    assert analysis.collect_routing(wrapped, ["", ""], progress=False).num_texts == 2


def test_cache_matches_plain_nnsight(qwen):
    wrapped, hf, cache, truth = qwen
    assert cache.layers == truth.layers == [moe.layer for moe in wrapped.moes]
    assert cache.num_shards > 1
    assert cache.num_tokens == truth.token_ids.numel() == sum(len(t) for t in TEXTS)
    assert cache.num_texts == len(TEXTS)
    assert torch.equal(cache.token_ids(), truth.token_ids)
    assert torch.equal(cache.text_index(), truth.text_index)
    assert torch.equal(cache.position(), truth.position)
    for layer in cache.layers:
        assert torch.equal(cache.indices(layer), truth.indices[layer])
        torch.testing.assert_close(cache.weights(layer), truth.weights[layer], atol=WEIGHT_ATOL, rtol=0)
        torch.testing.assert_close(cache.logits(layer), truth.logits[layer], atol=WEIGHT_ATOL, rtol=1e-3)
        torch.testing.assert_close(cache.probs(layer), torch.softmax(truth.logits[layer], -1), atol=1e-3, rtol=0)


def test_a_model_with_lasting_edits_past_the_blocks_is_analysed_to_the_end(qwen):
    """collect_routing stopped the forward after the last block (and the logit lens after its reads), so a
    lasting edit further on (model.edit(inplace=True)) failed the trace, blaming the user's read order."""
    wrapped, hf, cache, truth = qwen
    lens = analysis.expert_logit_lens(wrapped, TEXTS, max_length=MAX_LENGTH, progress=False)
    with wrapped.edit(inplace=True):
        wrapped.output.logits[:] = 0  # past every block: changes no routing
    try:
        edited = analysis.collect_routing(wrapped, TEXTS, batch_size=3, max_length=MAX_LENGTH, progress=False)
        edited_lens = analysis.expert_logit_lens(wrapped, TEXTS, max_length=MAX_LENGTH, progress=False)
        with torch.no_grad(), wrapped.trace(TEXTS[0]):  # the edit is there
            logits = wrapped.output.logits.save()
    finally:
        wrapped.clear_edits()
    assert not logits.any()
    for layer in edited.layers:
        assert torch.equal(edited.indices(layer), truth.indices[layer])
    assert torch.equal(edited_lens.counts, lens.counts) and torch.equal(edited_lens.mean_outputs, lens.mean_outputs)


def test_full_precision_cache_and_batch_size_do_not_matter(qwen):
    wrapped, hf, cache, truth = qwen
    exact = analysis.collect_routing(wrapped, TEXTS, batch_size=5, max_length=MAX_LENGTH, dtype=torch.float32,
                                     stop_early=False, progress=False)
    for layer in exact.layers:
        assert torch.equal(exact.indices(layer), truth.indices[layer])
        torch.testing.assert_close(exact.weights(layer), truth.weights[layer], atol=1e-6, rtol=1e-5)


def test_usage_is_a_bincount_of_the_plain_indices(qwen):
    wrapped, hf, cache, truth = qwen
    usage = analysis.expert_usage(cache)
    assert usage.tokens == truth.token_ids.numel()
    for row, layer in enumerate(truth.layers):
        indices = truth.indices[layer].flatten()
        assert torch.equal(usage.counts[row], torch.bincount(indices, minlength=8))
        expected = torch.zeros(8, dtype=torch.float64).index_add_(0, indices, truth.weights[layer].flatten().double())
        torch.testing.assert_close(usage.weight[row], expected, atol=0.05, rtol=1e-3)
        assert math.isclose(float(usage.fraction[row].sum()), 1.0)


def test_load_balance_by_hand(qwen):
    wrapped, hf, cache, truth = qwen
    balance = analysis.load_balance(cache)
    for row, layer in enumerate(truth.layers):
        counts = [0] * 8
        for expert in truth.indices[layer].flatten().tolist():
            counts[expert] += 1
        mean = sum(counts) / 8
        std = math.sqrt(sum((c - mean) ** 2 for c in counts) / 8)
        shares = [c / sum(counts) for c in counts]
        entropy = -sum(s * math.log(s) for s in shares if s > 0) / math.log(8)
        assert math.isclose(float(balance.cv[row]), std / mean, rel_tol=1e-9)
        assert math.isclose(float(balance.max_over_mean[row]), max(counts) / mean, rel_tol=1e-9)
        assert math.isclose(float(balance.min_over_mean[row]), min(counts) / mean, rel_tol=1e-9)
        assert math.isclose(float(balance.entropy[row]), entropy, rel_tol=1e-9)
        assert int(balance.unused[row]) == counts.count(0)


def test_load_balance_extremes():
    usage = analysis.Usage(layers=[0, 1], counts=torch.tensor([[5, 5, 5, 5], [20, 0, 0, 0]]),
                           weight=torch.zeros(2, 4, dtype=torch.float64), tokens=10, top_k=[2, 2])
    balance = analysis.load_balance(usage)
    assert balance.cv.tolist() == [0.0, pytest.approx(math.sqrt(3))]
    assert balance.max_over_mean.tolist() == [1.0, 4.0]
    assert balance.entropy.tolist() == [pytest.approx(1.0), 0.0]
    assert balance.unused.tolist() == [0, 3]


def test_the_balance_of_experts_no_token_chose_is_nan_not_balanced():
    """load_balance(num_experts=...) keeping only experts no token chose gave cv 0, which reads "balanced"."""
    usage = analysis.Usage(layers=[0, 1], counts=torch.tensor([[5, 5, 5, 5], [0, 0, 10, 10]]),
                           weight=torch.zeros(2, 4, dtype=torch.float64), tokens=10, top_k=[2, 2])
    balance = analysis.load_balance(usage, num_experts=[4, 2])
    assert balance.cv[0] == 0.0 and balance.unused.tolist() == [0, 2]
    for measure in (balance.cv, balance.max_over_mean, balance.min_over_mean, balance.entropy):
        assert math.isnan(float(measure[1]))
    row = balance.as_rows()[1]
    assert row["cv"] is None and row["usage_entropy"] is None and json.loads(json.dumps(row, allow_nan=False))


def balance_by_hand(counts: list[int]) -> tuple[float, float, float, float, int]:
    """(cv, max/mean, min/mean, normalised entropy, unused) of one layer's counts, in plain Python."""
    mean = sum(counts) / len(counts)
    std = math.sqrt(sum((c - mean) ** 2 for c in counts) / len(counts))
    shares = [c / sum(counts) for c in counts]
    entropy = -sum(s * math.log(s) for s in shares if s > 0) / math.log(len(counts))
    return std / mean, max(counts) / mean, min(counts) / mean, entropy, counts.count(0)


def test_load_balance_counts_each_layers_own_experts():
    """A layer with fewer experts than the widest: its padding columns are not unused experts."""
    tokens = {0: [[0, 1]] * 10, 1: [[0, 3], [0, 3], [1, 3], [0, 3]]}  # layer 0: E=2, layer 1: E=4
    shard = analysis.Shard(
        token_ids=torch.arange(10, dtype=torch.int32), text_index=torch.zeros(10, dtype=torch.int32),
        position=torch.arange(10, dtype=torch.int32),
        indices={0: torch.tensor(tokens[0], dtype=torch.int16), 1: torch.tensor(tokens[1] * 3, dtype=torch.int16)[:10]},
        weights={layer: torch.full((10, 2), 0.5) for layer in (0, 1)},
    )
    cache = analysis.RoutingCache(layers=[0, 1], num_experts={0: 2, 1: 4}, top_k={0: 2, 1: 2},
                                  score={0: "softmax", 1: "softmax"}, _memory=[shard])
    usage = analysis.expert_usage(cache)
    assert usage.num_experts == [2, 4] and usage.counts.shape == (2, 4)
    for balance in (usage.balance(), analysis.load_balance(usage), analysis.load_balance(cache)):
        for row, layer in enumerate(cache.layers):
            counts = [0] * cache.num_experts[layer]
            for chosen in shard.indices[layer].tolist():
                for expert in chosen:
                    counts[expert] += 1
            cv, high, low, entropy, unused = balance_by_hand(counts)
            assert math.isclose(float(balance.cv[row]), cv, abs_tol=1e-12)
            assert math.isclose(float(balance.max_over_mean[row]), high, rel_tol=1e-9)
            assert math.isclose(float(balance.min_over_mean[row]), low, rel_tol=1e-9)
            assert math.isclose(float(balance.entropy[row]), entropy, rel_tol=1e-9)
            assert int(balance.unused[row]) == unused
        assert float(balance.cv[0]) == 0.0 and int(balance.unused[0]) == 0
    # a Usage built by hand takes its width as every layer's E unless told
    wide = analysis.Usage(layers=[0], counts=torch.tensor([[10, 10, 0, 0]]), weight=torch.zeros(1, 4, dtype=torch.float64),
                          tokens=10, top_k=[2])
    assert wide.num_experts == [4] and int(wide.balance().unused[0]) == 2


def entropy_by_hand(rows: torch.Tensor) -> list[float]:
    result = []
    for row in rows.double().tolist():
        total = sum(row)
        p = [value / total for value in row]
        result.append(-sum(x * math.log(x) for x in p if x > 0) / math.log(len(p)))
    return result


def test_routing_entropy_by_hand(qwen):
    wrapped, hf, cache, truth = qwen
    router = analysis.routing_entropy(cache, bins=10)
    weights = analysis.routing_entropy(cache, "weights", bins=10)
    assert router.source == "router" and weights.source == "weights"
    for row, layer in enumerate(truth.layers):
        expected = entropy_by_hand(torch.softmax(truth.logits[layer].double(), -1))
        per_token = analysis.token_entropy(cache, layer)
        torch.testing.assert_close(per_token, torch.tensor(expected, dtype=torch.float64), atol=1e-3, rtol=0)
        assert math.isclose(float(router.mean[row]), sum(expected) / len(expected), abs_tol=1e-3)
        assert int(router.histogram[row].sum()) == len(expected)
        by_weight = entropy_by_hand(truth.weights[layer])
        assert math.isclose(float(weights.mean[row]), sum(by_weight) / len(by_weight), abs_tol=1e-3)


def test_coactivation_by_hand(qwen):
    wrapped, hf, cache, truth = qwen
    for layer in truth.layers:
        expected = torch.zeros(8, 8, dtype=torch.int64)
        for chosen in truth.indices[layer].tolist():
            for i in set(chosen):
                for j in set(chosen):
                    expected[i, j] += 1
        result = analysis.coactivation(cache, layer)
        assert torch.equal(result.counts, expected)
        conditional = result.conditional()
        for i in range(8):
            if expected[i, i]:
                assert math.isclose(float(conditional[i, (i + 1) % 8]), int(expected[i, (i + 1) % 8]) / int(expected[i, i]))


def top1_by_hand(truth: Truth, layer: int) -> list[int]:
    return [chosen[max(range(len(w)), key=lambda s: w[s])]
            for chosen, w in zip(truth.indices[layer].tolist(), truth.weights[layer].tolist())]


def test_transitions_and_paths_by_hand(qwen):
    wrapped, hf, cache, truth = qwen
    first, second = truth.layers[0], truth.layers[1]
    top = {layer: top1_by_hand(truth, layer) for layer in truth.layers}
    expected = torch.zeros(8, 8, dtype=torch.int64)
    for a, b in zip(top[first], top[second]):
        expected[a, b] += 1
    assert torch.equal(analysis.transitions(cache, first, second).counts, expected)
    every = torch.zeros(8, 8, dtype=torch.int64)
    for chosen_a, chosen_b in zip(truth.indices[first].tolist(), truth.indices[second].tolist()):
        for a in chosen_a:
            for b in chosen_b:
                every[a, b] += 1
    assert torch.equal(analysis.transitions(cache, first, second, slots="all").counts, every)
    paths = Counter(zip(*(top[layer] for layer in truth.layers)))
    assert analysis.token_paths(cache).tolist() == [list(path) for path in zip(*(top[layer] for layer in truth.layers))]
    assert analysis.token_paths(cache, [second, first]).tolist() == [[b, a] for a, b in zip(top[first], top[second])]
    result = analysis.expert_paths(cache, top=5)
    assert [count for _, count in result] == [count for _, count in paths.most_common(5)]
    for path, count in result:
        assert paths[path] == count


def test_transition_conditionals_by_hand(qwen):
    # P(j in the target layer | i in the source layer): of the tokens routed to i, the share also routed to j
    # (with slots="all" a token routed to i has k experts in the target: its row sums to k, not 1).
    wrapped, hf, cache, truth = qwen
    first, second = truth.layers[0], truth.layers[1]
    experts = {"all": {layer: truth.indices[layer].tolist() for layer in (first, second)},
               "top1": {layer: [[expert] for expert in top1_by_hand(truth, layer)] for layer in (first, second)}}
    for slots, chosen in experts.items():
        result = analysis.transitions(cache, first, second, slots=slots)
        conditional = result.conditional()
        for i in range(8):
            given = [n for n, source in enumerate(chosen[first]) if i in source]
            for j in range(8):
                expected = sum(j in chosen[second][n] for n in given) / len(given) if given else 0.0
                assert math.isclose(float(conditional[i, j]), expected), (slots, i, j)
            assert int(result.sources[i]) == len(given)
        figure = analysis.plots.plot_transitions(result)
        drawn = torch.as_tensor(figure.axes[0].images[0].get_array().data)
        assert torch.allclose(drawn, conditional.float()) and float(drawn.max()) <= 1.0
        analysis.plots.pyplot().close(figure)


def test_top_tokens_by_hand(qwen):
    wrapped, hf, cache, truth = qwen
    layer = truth.layers[-1]
    pairs: Counter = Counter()
    seen = Counter(truth.token_ids.tolist())
    for token, chosen in zip(truth.token_ids.tolist(), truth.indices[layer].tolist()):
        for expert in chosen:
            pairs[(expert, token)] += 1
    items = analysis.top_tokens(cache, layer, n=4, tokenizer=wrapped.tokenizer)
    assert [item.expert for item in items] == list(range(8))
    for item in items:
        mine = {token: count for (expert, token), count in pairs.items() if expert == item.expert}
        assert item.total == sum(mine.values())
        assert len(item.counts) == len(item.token_ids) == len(item.tokens) == min(4, len(mine))
        assert item.counts.tolist() == sorted(mine.values(), reverse=True)[:4]
        for token, count, share, text in zip(item.token_ids.tolist(), item.counts.tolist(), item.share.tolist(), item.tokens):
            assert mine[token] == count
            assert math.isclose(share, count / seen[token])
            assert text == shown(token)
    by_share = analysis.top_tokens(cache, layer, [0], n=3, by="share", min_count=2)[0]
    assert len(by_share.token_ids) == min(3, sum(seen[token] >= 2 for (expert, token) in pairs if expert == 0)) > 0
    for token, share in zip(by_share.token_ids.tolist(), by_share.share.tolist()):
        assert seen[token] >= 2 and math.isclose(share, pairs[(0, token)] / seen[token])


def test_top_tokens_decodes_with_the_tokenizer_the_cache_was_collected_with(qwen, tmp_path):
    """top_tokens showed #<id> for every token unless given tokenizer= again, though the cache came from a model
    with one; a saved cache holds no tokenizer: RoutingCache.load takes one."""
    wrapped, hf, cache, truth = qwen
    layer = truth.layers[-1]
    decoded = [[shown(token) for token in item.token_ids.tolist()] for item in analysis.top_tokens(cache, layer, n=3)]
    assert [item.tokens for item in analysis.top_tokens(cache, layer, n=3)] == decoded
    cache.save(tmp_path / "routing")
    loaded = analysis.RoutingCache.load(tmp_path / "routing")
    ids = [item.token_ids.tolist() for item in analysis.top_tokens(loaded, layer, n=3)]
    assert [item.tokens for item in analysis.top_tokens(loaded, layer, n=3)] == [[f"#{t}" for t in row] for row in ids]
    loaded = analysis.RoutingCache.load(tmp_path / "routing", tokenizer=wrapped.tokenizer)
    assert [item.tokens for item in analysis.top_tokens(loaded, layer, n=3)] == decoded
    assert [item.tokens for item in analysis.top_tokens(loaded.materialize(), layer, n=3)] == decoded
    with pytest.raises(MoelensError, match="tokenizer must be a tokenizer with a decode method"):
        analysis.RoutingCache.load(tmp_path / "routing", tokenizer=wrapped)


def test_specialisation_by_hand(qwen):
    wrapped, hf, cache, truth = qwen
    labels = torch.tensor([0, 1, 1, 0, 1])  # per text: code, prose
    spec = analysis.specialisation(cache, labels, ["code", "prose"], per="text")
    per_token = analysis.specialisation(cache, labels[truth.text_index], ["code", "prose"])
    assert torch.equal(spec.counts, per_token.counts)
    for row, layer in enumerate(truth.layers):
        expected = torch.zeros(8, 2, dtype=torch.int64)
        for text, chosen in zip(truth.text_index.tolist(), truth.indices[layer].tolist()):
            for expert in chosen:
                expected[expert, int(labels[text])] += 1
        assert torch.equal(spec.counts[row], expected)
        base = expected.sum(0).double() / expected.sum()
        share = expected.double() / expected.sum(1, keepdim=True).clamp(min=1)
        torch.testing.assert_close(spec.lift()[row], share / base)
    ignored = analysis.specialisation(cache, torch.full((cache.num_tokens,), 255), ["code"])
    assert int(ignored.counts.sum()) == 0
    with pytest.raises(MoelensError, match="one entry per cached token"):
        analysis.specialisation(cache, torch.zeros(3))


def test_token_routing_matches_plain_nnsight(qwen):
    wrapped, hf, cache, truth = qwen
    text = TEXTS[0]
    view = analysis.token_routing(wrapped, text)
    ids = wrapped.tokenizer(text, add_special_tokens=False)["input_ids"]
    reference = copy.deepcopy(hf)
    one = plain_truth(reference, wrapped, [ids], 10**6)
    assert view.tokens == [shown(token) for token in ids]
    assert view.tokens[:4] == ["d", "e", "f", "\u00b7"]
    for row, layer in enumerate(one.layers):
        order = torch.argsort(one.weights[layer], dim=-1, descending=True, stable=True)
        assert torch.equal(view.indices[row], one.indices[layer].gather(-1, order))
        torch.testing.assert_close(view.weights[row], one.weights[layer].gather(-1, order))
        torch.testing.assert_close(view.probs[row], torch.softmax(one.logits[layer], -1))
    table = view.table()
    assert table.splitlines()[0].split()[:3] == ["token", "layer", str(one.layers[0])]
    assert len(table.splitlines()) == 2 + len(text)
    assert view.table(width=1).splitlines()[2].startswith("d  ")  # width: the characters of each token shown
    for width in (0, -5, "14", 2.5):  # 0 showed every token as nothing; the others failed inside str.format
        with pytest.raises(MoelensError, match=rf"width must be an integer of at least 1, got {width!r}\."):
            view.table(width=width)


def test_expert_logit_lens_by_hand(qwen):
    wrapped, hf, cache, truth = qwen
    lens = analysis.expert_logit_lens(wrapped, TEXTS, top=5, batch_size=2, max_length=MAX_LENGTH, progress=False)
    assert lens.norm == "model.norm"
    for row, layer in enumerate(truth.layers):
        experts = wrapped.moes[row].experts._module
        sums = torch.zeros(8, hf.config.hidden_size, dtype=torch.float64)
        counts = torch.zeros(8, dtype=torch.int64)
        with torch.no_grad():
            for token in range(truth.token_ids.numel()):
                for slot in range(truth.indices[layer].shape[1]):
                    expert = int(truth.indices[layer][token, slot])
                    _, out = expert_forward(experts, truth.hidden[layer][token : token + 1], expert)
                    sums[expert] += (out[0] * truth.weights[layer][token, slot]).double()
                    counts[expert] += 1
            assert torch.equal(lens.counts[row], counts)
            means = sums / counts.clamp(min=1)[:, None]
            torch.testing.assert_close(lens.mean_outputs[row], means.float(), atol=1e-5, rtol=1e-4)
            logits = hf.lm_head(hf.model.norm(means.float()))
        for expert in range(8):
            if counts[expert]:
                expected = logits[expert].topk(5).indices
                assert lens.top_ids[row, expert].tolist() == expected.tolist()
                assert lens.promoted(layer, expert) == [shown(i) for i in expected.tolist()]
    relative = analysis.expert_logit_lens(wrapped, TEXTS[:2], top=3, relative=True, progress=False)
    assert relative.relative and relative.top_ids.shape[-1] == 3


def test_the_logit_lens_of_a_bfloat16_model_reads_out_in_float32():
    """The readout ran in the model's bfloat16: logits of ~3 digits, near tokens tied and ranked by rounding."""
    hf = tiny_model("qwen2_moe").to(torch.bfloat16)
    wrapped = moelens.wrap(hf, tokenizer=ascii_tokenizer())
    lens = analysis.expert_logit_lens(wrapped, TEXTS, top=5, progress=False)
    norm, head = hf.model.norm, hf.lm_head
    assert norm.weight.dtype == head.weight.dtype == torch.bfloat16  # left as they were
    means = lens.mean_outputs.double()  # by hand, in float64: RMSNorm, then the unembedding
    normed = means * torch.rsqrt(means.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight.double()
    logits = normed @ head.weight.double().T
    for row in range(len(lens.layers)):
        for expert in torch.nonzero(lens.counts[row]).flatten().tolist():
            expected = logits[row, expert].topk(5)
            torch.testing.assert_close(lens.top_logits[row, expert].double(), expected.values, atol=1e-6, rtol=1e-4)
            assert lens.top_ids[row, expert].tolist() == expected.indices.tolist()


# -- other families (no tokenizer: token-id corpora) ---------------------------------------------------

OTHER_FAMILIES = ["mixtral", "deepseek_v3", "dbrx", "llama4", "longcat_flash"]


@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_usage_matches_plain_nnsight_in_other_families(family):
    hf = tiny_model(family)
    reference = copy.deepcopy(hf)
    wrapped = moelens.wrap(hf)
    generator = torch.Generator().manual_seed(1)
    token_lists = [torch.randint(4, 120, (length,), generator=generator).tolist() for length in (7, 3, 9, 5)]
    cache = analysis.collect_routing(wrapped, token_lists, batch_size=3, max_length=8, logits=True, progress=False)
    truth = plain_truth(reference, wrapped, token_lists, 8)
    usage = analysis.expert_usage(cache)
    assert cache.family == family
    for row, layer in enumerate(truth.layers):
        E = cache.num_experts[layer]
        assert torch.equal(cache.indices(layer), truth.indices[layer])
        assert torch.equal(usage.counts[row, :E], torch.bincount(truth.indices[layer].flatten(), minlength=E))
        torch.testing.assert_close(cache.logits(layer), truth.logits[layer], atol=WEIGHT_ATOL, rtol=1e-3)
    if wrapped.moes[0].experts_implementation == "eager":
        # the block's own reason: the switch to grouped_mm, or why the family has no per-slot tensor
        reason = "grouped_mm" if "expert_outputs" in wrapped.moes[0].order() else "no per-slot"
        if zero_compute_experts(hf):  # longcat_flash: no implementation runs those slots
            reason = "zero-compute"
        with pytest.raises(ValueUnavailable, match=reason):
            analysis.expert_logit_lens(wrapped, token_lists, progress=False)


def test_no_moe_and_bad_corpus_errors(qwen):
    wrapped, hf, cache, truth = qwen
    from transformers import Qwen2Config, Qwen2ForCausalLM

    dense = moelens.wrap(Qwen2ForCausalLM(Qwen2Config(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                       num_attention_heads=2, num_key_value_heads=2, vocab_size=64)))
    with pytest.raises(MoelensError, match="no Mixture-of-Experts layer"):
        analysis.collect_routing(dense, [[1, 2, 3]], progress=False)
    no_tokenizer = moelens.wrap(tiny_model("mixtral"))
    with pytest.raises(MoelensError, match="no tokenizer"):
        analysis.collect_routing(no_tokenizer, ["text"], progress=False)
    with pytest.raises(MoelensError, match="not MoE layers"):
        analysis.collect_routing(wrapped, TEXTS, layers=[0], progress=False)
    with pytest.raises(MoelensError, match="no router logits"):
        analysis.collect_routing(wrapped, TEXTS[:1], progress=False).logits(1)
    with pytest.raises(MoelensError, match="logits=True"):
        analysis.routing_entropy(analysis.collect_routing(wrapped, TEXTS[:1], progress=False), "router")
    with pytest.raises(MoelensError, match="max_length must be an integer of at least 1, got 0"):
        analysis.collect_routing(wrapped, TEXTS, max_length=0, progress=False)  # was taken as the default
    with pytest.raises(MoelensError, match=r"experts \[42\] are not experts of layer 1, which has experts 0..7"):
        analysis.top_tokens(cache, 1, experts=[42])
    with pytest.raises(MoelensError, match=r"tokenizer's output with input_ids.*\['text'\]"):
        analysis.collect_routing(wrapped, {"text": TEXTS}, progress=False)


def test_a_tokenizers_padded_output_is_its_real_tokens(qwen):
    # The padding of a tokenizer's output is dropped by its mask: the cache equals that of the texts.
    wrapped, hf, cache, truth = qwen
    texts = [text for text in TEXTS if text]
    tokenizer = wrapped.tokenizer
    original = tokenizer.padding_side
    for side in ("left", "right"):
        tokenizer.padding_side = side
        encoded = tokenizer(texts, padding=True, add_special_tokens=False, return_tensors="pt")
        assert (encoded["attention_mask"] == 0).any()
        padded = analysis.collect_routing(wrapped, encoded, max_length=MAX_LENGTH, progress=False)
        plain = analysis.collect_routing(wrapped, texts, max_length=MAX_LENGTH, progress=False)
        assert torch.equal(padded.token_ids(), plain.token_ids()) and torch.equal(padded.text_index(), plain.text_index())
        for layer in plain.layers:
            assert torch.equal(padded.indices(layer), plain.indices(layer))
    tokenizer.padding_side = original


def test_plots_are_images(qwen, tmp_path):
    wrapped, hf, cache, truth = qwen
    plots = analysis.plots
    usage = analysis.expert_usage(cache)
    view = analysis.token_routing(wrapped, TEXTS[0])
    lens = analysis.expert_logit_lens(wrapped, TEXTS[:2], top=4, progress=False)
    spec = analysis.specialisation(cache, torch.tensor([0, 1, 1, 0, 1]), ["code", "prose"], per="text")
    with warnings.catch_warnings():  # no deprecated path (a tensor handed to matplotlib: numpy 2's __array__ warning)
        warnings.simplefilter("error", DeprecationWarning)
        figures = plot_each(plots, usage, cache, view, lens, spec)
    for name, figure in figures.items():
        path = plots.save(figure, tmp_path / f"{name}.png")
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert path.stat().st_size > 5000, name


def plot_each(plots, usage, cache, view, lens, spec) -> dict:
    return {
        "usage": plots.plot_usage(usage),
        "balance": plots.plot_load_balance(usage.balance()),
        "entropy": plots.plot_entropy(analysis.routing_entropy(cache)),
        "coactivation": plots.plot_coactivation([analysis.coactivation(cache, layer) for layer in cache.layers]),
        "transitions": plots.plot_transitions(analysis.transitions(cache, 1, 2)),
        "tokens": plots.plot_token_routing(view),
        "top_tokens": plots.plot_top_tokens(analysis.top_tokens(cache, 1, [0, 1], n=3)),
        "lens": plots.plot_logit_lens(lens),
        "specialisation": plots.plot_specialisation(spec),
    }


def test_describe_lists_the_layers_that_hold_a_dense_mlp():
    """It listed every layer that is not an MoE layer: nemotron_h's Mamba and attention layers (no MLP)
    as dense, and a mixed model's dense layers right only by chance."""
    from moelens.components import Mlp

    for hf in (tiny_model("nemotron_h", layers_block_type=["mamba", "moe", "attention", "moe"]), tiny_model("deepseek_v3")):
        wrapped = moelens.wrap(hf)
        expected = [index for index, layer in enumerate(wrapped.layers) if type(getattr(layer, "mlp", None)) is Mlp]
        assert analysis.describe(wrapped, probe=False).dense_layers == expected
    assert expected == [0]  # deepseek_v3's first_k_dense_replace


def test_describe_counts_an_encoder_decoders_layers_per_list():
    """T5 converted by compress (3 encoder, 2 decoder layers): describe said "decoder layers 3" (the config's
    num_hidden_layers, the encoder's) and "MoE layers 0, 1, 2 (3 of 3)", encoder and decoder layer 0 counted
    as one. Ground truth: the config's layer counts and the blocks' module paths."""
    from transformers import T5Config, T5ForConditionalGeneration

    from moelens.compress import tomoe

    torch.manual_seed(0)
    config = T5Config(vocab_size=64, d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=3, num_decoder_layers=2,
                      decoder_start_token_id=0, pad_token_id=0)
    ids = torch.randint(1, 64, (2, 8))
    converted = tomoe(T5ForConditionalGeneration(config).eval(), calibration={"input_ids": ids, "decoder_input_ids": ids},
                      num_experts=4, top_k=2, max_error=None, progress=False, target_modules=["wo"])
    report = analysis.describe(moelens.wrap(converted), probe=False)
    assert report.layer_stacks == {"encoder.block": config.num_layers, "decoder.block": config.num_decoder_layers}
    assert report.num_layers == 5
    expected = [f"{stack}.block {index}" for stack, count in (("encoder", 3), ("decoder", 2)) for index in range(count)]
    assert [layer.label for layer in report.moe_layers] == expected
    assert [layer.path.split(".layer.")[0].replace(".block.", ".block ") for layer in report.moe_layers] == expected
    text = str(report)
    assert "layers                 5 (encoder.block 3, decoder.block 2)" in text
    assert f"MoE layers             {', '.join(expected)} (5 of 5)" in text


def test_hash_routed_layers_are_described_and_scored_per_block():
    """deepseek_v4 routes its first layers by a token table: describe and the cache say so per block."""
    hf = tiny_model("deepseek_v4")
    wrapped = moelens.wrap(hf)
    hashed = [layer for layer, kind in enumerate(hf.config.mlp_layer_types) if kind == "hash_moe"]
    routed = [layer for layer, kind in enumerate(hf.config.mlp_layer_types) if kind == "moe"]
    assert hashed and routed
    report = analysis.describe(wrapped, probe=False)
    assert "config." not in report.scoring and report.score == hf.config.scoring_func
    groups = dict(part.split(": ", 1) for part in report.scoring.split("; "))
    assert groups[f"layer{'s' if len(hashed) > 1 else ''} {', '.join(map(str, hashed))}"].startswith(
        f"{hf.config.scoring_func} scores, hash")
    assert "hash" not in groups[f"layers {', '.join(map(str, routed))}"]
    cache = analysis.collect_routing(wrapped, torch.tensor([[5, 6, 7, 8]]), progress=False)
    assert cache.score == {layer: hf.config.scoring_func for layer in hashed + routed}


@pytest.mark.parametrize(("family", "settings", "expected", "absent"), [
    # axk2 built without groups: its router skips group selection (groups_of None)
    ("axk2", {"n_group": None, "topk_group": None}, "sigmoid scores, score topk, selection bias", "group"),
    ("deepseek_v3", {"n_group": 2, "topk_group": 1}, "group-limited (best 1 of 2 groups), renormalised", "router."),
    # deepseek_v2's groups apply only under topk_method group_limited_greedy; its scale is 1.0
    ("deepseek_v2", {"topk_method": "greedy"}, "softmax scores, score topk (DS2)", "group"),
    ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2},
     "group-limited (best 2 of 4 groups)", "=="),
    ("qwen2_moe", {"norm_topk_prob": False}, "softmax scores, score topk", "renormalised"),
    # every group kept: plain top-k over all experts
    ("deepseek_v3", {"n_group": 1, "topk_group": 1}, "sigmoid scores, score topk, selection bias", "group"),
    ("deepseek_v3", {"n_group": 2, "topk_group": 2}, "sigmoid scores, score topk, selection bias", "group"),
])
def test_describe_says_what_this_models_router_does(family, settings, expected, absent):
    """The scoring line printed the entry's references (`renormalised if router.norm_topk_prob`, `x
    router.routed_scaling_factor`, `group-limited if router.topk_method == ...`), "group-limited" for an axk2
    router with no groups, and "group-limited (best 1 of 1 groups)" where every group is kept. Truth: the router's
    own settings."""
    hf = tiny_model(family, **settings)
    report = analysis.describe(moelens.wrap(hf), probe=False)
    assert expected in report.scoring and absent not in report.scoring, report.scoring
    router = hf.model.layers[-1].mlp.gate
    scale = getattr(router, "routed_scaling_factor", 1.0)
    assert (f"x {scale}" in report.scoring) is (scale != 1.0), report.scoring


def test_describe_names_the_layers_of_each_top_k_and_dbrxs_p_norm():
    """A per-layer top-k printed "E=8, k=1; E=8, k=2; ..." with no layers; dbrx's normalisation read
    "renormalised if block.moe_normalize_expert_weights" whatever p is."""
    from moelens.testing import tiny_config

    hf = tiny_model("hunyuan_v1_moe", moe_topk=[1, 2, 3, 2])
    report = analysis.describe(moelens.wrap(hf), probe=False)
    line = next(line for line in str(report).splitlines() if line.startswith("experts E, top-k"))
    assert line.endswith("layer 0: E=8, k=1; layers 1, 3: E=8, k=2; layer 2: E=8, k=3")
    assert [layer.mlp.gate.top_k for layer in hf.model.layers] == [1, 2, 3, 2]
    ffn = tiny_config("dbrx").ffn_config.to_dict() | {"moe_normalize_expert_weights": 2.0}
    hf = tiny_model("dbrx", ffn_config=ffn)
    assert "divided by their 2-norm" in analysis.describe(moelens.wrap(hf), probe=False).scoring
    assert "renormalised (" in analysis.describe(moelens.wrap(tiny_model("dbrx")), probe=False).scoring  # p = 1


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_collects_and_counts(family):
    """The cache reads through each family's own values: it holds the plain-nnsight routing, one count per slot."""
    hf = tiny_model(family)
    reference = copy.deepcopy(hf)
    wrapped = moelens.wrap(hf)
    layers = [moe.layer for moe in wrapped.moes]
    blocks = "text_moe" if len(set(layers)) < len(layers) else None  # ernie4_5_vl_moe: text and vision blocks
    ids = torch.randint(4, 100, (3, 6), generator=torch.Generator().manual_seed(0))
    cache = analysis.collect_routing(wrapped, ids, batch_size=2, logits=True, blocks=blocks, progress=False)
    usage = analysis.expert_usage(cache)
    assert cache.family == wrapped.family.name and cache.num_tokens == ids.numel()
    # the truth: plain nnsight on an unwrapped copy, over the same batches (no padding: equal rows)
    moes = [moe for moe in wrapped.moes if blocks is None or blocks in moe.path]
    names = [moe.path.removeprefix("model.") for moe in moes]
    raws = [raw_values(reference, {"input_ids": part, "attention_mask": torch.ones_like(part)}, names, wrapped.family)
            for part in ids.split(2)]
    for row, (layer, name, moe) in enumerate(zip(cache.layers, names, moes)):
        logits = torch.cat([raw[name].logits.reshape(-1, raw[name].logits.shape[-1]) for raw in raws])
        if wrapped.family.derived_routing:
            truth = torch.topk(logits, moe.top_k, dim=-1).indices
        else:
            truth = torch.cat([raw[name].routing[1].reshape(-1, moe.top_k) for raw in raws])
            weights = torch.cat([raw[name].routing[2].reshape(-1, moe.top_k) for raw in raws])
            torch.testing.assert_close(cache.weights(layer).float(), weights.float(), atol=WEIGHT_ATOL, rtol=1e-3)
        if family == "zaya":  # the skip class (the last logit column): those slots ran no expert
            biases = reference.get_submodule(name).get_submodule(wrapped.family.router).balancing_biases
            chosen = torch.topk(logits.softmax(-1) + biases, moe.top_k, dim=-1).indices
            truth = truth.masked_fill(chosen == logits.shape[-1] - 1, analysis.cache.SKIPPED)
        indices = cache.indices(layer)
        assert indices.shape == (ids.numel(), cache.top_k[layer])
        assert torch.equal(indices.long(), truth.long())
        assert analysis.cache.SKIPPED <= int(indices.min()) and int(indices.max()) < cache.num_experts[layer]
        ran = truth[truth != analysis.cache.SKIPPED]
        assert torch.equal(usage.counts[row, : cache.num_experts[layer]],
                           torch.bincount(ran.flatten(), minlength=cache.num_experts[layer]))
        if family == "zaya":  # every count leaves the skipped slots out
            E = cache.num_experts[layer]
            assert torch.equal(analysis.coactivation(cache, layer).counts.diagonal(), usage.counts[row, :E])
            assert [item.total for item in analysis.top_tokens(cache, layer)] == usage.counts[row, :E].tolist()
        # inkling's router adds columns past E (docs/values.md): compare the ones the router returns
        torch.testing.assert_close(cache.logits(layer)[:, : logits.shape[-1]].float(), logits.float(),
                                   atol=WEIGHT_ATOL, rtol=1e-3)
        probs = cache.probs(layer)
        assert probs.shape[0] == ids.numel() and probs.shape[1] >= cache.num_experts[layer]
    if family == "zaya":  # the logit lens averages over the slots that ran each expert
        assert torch.equal(analysis.expert_logit_lens(wrapped, ids, progress=False).counts, usage.counts)


def test_logit_lens_reads_latent_experts_in_the_hidden_space():
    # nemotron_h with moe_latent_size: experts work in a 16-wide latent space, fc2_latent_proj maps their sum back.
    hf = tiny_model("nemotron_h", moe_latent_size=16)
    reference = copy.deepcopy(hf)
    wrapped = moelens.wrap(hf)
    corpus = [list(range(3, 23)), list(range(30, 50))]
    lens = analysis.expert_logit_lens(wrapped, corpus, progress=False)
    assert lens.mean_outputs.shape[-1] == hf.config.hidden_size
    plain = nnsight.NNsight(reference)
    for row, moe in enumerate(wrapped.moes):
        projection = reference.get_submodule(moe.path.removeprefix("model.")).fc2_latent_proj
        bias = projection.bias if projection.bias is not None else torch.zeros(hf.config.hidden_size,
                                                                               device=hf.device)
        total = torch.zeros(hf.config.hidden_size, dtype=torch.float64)
        for ids in corpus:
            with plain.trace(torch.tensor([ids], device=hf.device)):
                projected = plain.get(moe.path.removeprefix("model.")).fc2_latent_proj.output.save()
            total += (projected.reshape(-1, hf.config.hidden_size) - bias).double().detach().sum(0).cpu()  # a lens is on the CPU
        by_expert = (lens.mean_outputs[row].double() * lens.counts[row, :, None]).sum(0)
        torch.testing.assert_close(by_expert, total, atol=1e-4, rtol=1e-4)


def test_token_routing_runs_a_text_longer_than_the_context_in_windows(qwen):
    """Beyond ``max_position_embeddings`` the text is routed in context-long windows, as the
    routing cache routes it (never as one pass the model was not built for)."""
    wrapped, hf, cache, truth = qwen
    reference = copy.deepcopy(hf)
    context = 8
    short = moelens.wrap(copy.deepcopy(hf), tokenizer=wrapped.tokenizer)
    short._module.config.max_position_embeddings = context
    text = TEXTS[1]
    ids = wrapped.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 2 * context
    view = analysis.token_routing(short, text)
    windows = plain_truth(reference, wrapped, [ids], context)
    for row, layer in enumerate(windows.layers):
        order = torch.argsort(windows.weights[layer], dim=-1, descending=True, stable=True)
        assert torch.equal(view.indices[row], windows.indices[layer].gather(-1, order))
    streamed = analysis.collect_routing(short, [text], progress=False, dtype=torch.float32)
    assert torch.equal(view.indices[0].sort(-1).values, streamed.indices(windows.layers[0]).long().sort(-1).values)


def test_token_routing_of_layers_with_different_experts_and_top_k():
    """A model converted with E=4, k=1 in one layer and E=8, k=3 in another: the view pads the smaller
    layer with skipped slots (weight 0) and zero probabilities, and keeps each layer's own routing."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from moelens.compress import tomoe

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    calibration = torch.randint(3, 128, (8, 32))
    model = tomoe(LlamaForCausalLM(config).eval(), num_experts=4, top_k=1, calibration=calibration, max_error=None,
                  target_modules=["model.layers.0.mlp"], progress=False)
    model = tomoe(model, num_experts=8, top_k=3, calibration=calibration, max_error=None,
                  target_modules=["model.layers.2.mlp"], progress=False)
    blocks = {0: model.model.layers[0].mlp, 2: model.model.layers[2].mlp}
    logits = {}  # each converted block's router logits, from a plain forward hook on its router
    handles = [block.router.register_forward_hook(
        lambda module, args, out, layer=layer: logits.update({layer: (args[0] @ module.weight.T + module.bias).detach()}))
        for layer, block in blocks.items()]
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7, 8]]))
    for handle in handles:
        handle.remove()
    wrapped = moelens.wrap(model)
    view = analysis.token_routing(wrapped, [5, 6, 7, 8])
    assert view.indices.shape == (2, 4, 3) and view.probs.shape == (2, 4, 8)
    for row, (layer, k, experts) in enumerate([(0, 1, 4), (2, 3, 8)]):
        expected = torch.topk(logits[layer].reshape(4, -1), k, dim=-1).indices
        assert torch.equal(view.indices[row, :, :k].sort(-1).values, expected.sort(-1).values)
        assert (view.indices[row, :, k:] == SKIPPED).all() and (view.weights[row, :, k:] == 0).all()
        assert (view.probs[row, :, experts:] == 0).all()
    assert "skip" in view.table()
    analysis.plots.plot_token_routing(view)
    # the logit lens: each layer's own E, and nothing read from a row of -inf logits (it gave ten junk tokens for
    # an expert of a layer that has fewer, and for one no token reached)
    lens = analysis.expert_logit_lens(wrapped, [[5, 6, 7, 8]], progress=False)
    assert lens.num_experts == [4, 8]
    with pytest.raises(MoelensError, match=r"experts \[6\] are not experts of layer 0, which has experts 0\.\.3"):
        lens.promoted(0, 6)
    for row, layer in enumerate((0, 2)):
        ran = torch.bincount(view.indices[row][view.indices[row] != SKIPPED].flatten(), minlength=8)
        assert torch.equal(lens.counts[row], ran)
        for expert in range(lens.num_experts[row]):
            promoted = lens.promoted(layer, expert)
            assert (promoted == []) == (int(ran[expert]) == 0) and len(promoted) in (0, 10)
    assert (lens.counts[0] == 0).any()  # 4 tokens on layer 0's experts, not every one reached


def test_bad_analysis_input_gets_a_clear_error(qwen):
    wrapped, hf, cache, truth = qwen
    vocab = hf.config.vocab_size
    cases = [
        (lambda: analysis.collect_routing(wrapped, [[5, 6]], layers=[], progress=False), r"layers=\[\] selects no MoE layer"),
        (lambda: analysis.collect_routing(wrapped, [[5, vocab, 7]], progress=False),
         rf"corpus item 0 holds token id {vocab}, outside the model's vocabulary \[0, {vocab}\); pass ids from the "
         r"model's own tokenizer \(a token added to it after training.*resize_token_embeddings"),  # it said "own" alone
        (lambda: analysis.expert_logit_lens(wrapped, [[1], [5, -1]], progress=False), r"corpus item 1 holds token id -1"),
        (lambda: analysis.routing_entropy(cache, bins=0), "bins must be an integer of at least 1, got 0"),
        (lambda: analysis.expert_paths(cache, layers=[]), r"layers=\[\] names no layer"),
        (lambda: analysis.token_paths(cache, layers=[]), r"^token_paths: layers=\[\] names no layer"),
        (lambda: analysis.plots.plot_coactivation([]), "nothing to plot"),
    ]
    for call, match in cases:
        with pytest.raises(MoelensError, match=match):
            call()


@pytest.mark.parametrize(("family", "norm"), [("mixtral", "norm"), ("lfm2_moe", "embedding_norm"), ("llama4", "norm")])
def test_readout_is_the_final_norm_and_the_unembedding_of_the_model(family, norm):
    """analysis.readout(model, x) of the final norm's input is the model's logits, and of a token's one expert output
    (MoE Lens) lm_head(norm(x)) of the plain modules (lfm2_moe's last norm is embedding_norm; llama4's *ForCausalLM
    names its base model by a prefix it does not have, and its norm was missed); in float32 for a bfloat16 model (by
    float32 copies: the model keeps its dtype)."""
    hf = tiny_model(family)
    torch.manual_seed(3)
    final = getattr(hf.model, norm)
    with torch.no_grad():
        final.weight.uniform_(0.2, 3.0)  # a trained norm is not all ones
    ids = torch.tensor([[5, 6, 7, 8]])
    seen = []
    hook = final.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    with torch.no_grad():
        logits = hf(ids).logits
    hook.remove()
    wrapped = moelens.wrap(hf)
    with torch.no_grad():
        assert torch.equal(analysis.readout(wrapped, seen[0]), logits)
        # one vector alone: its matmul rounds otherwise than the batch's, within float32's
        torch.testing.assert_close(analysis.readout(hf, seen[0][0, 2]), logits[0, 2], rtol=1e-6, atol=1e-6)
        half = copy.deepcopy(hf).to(torch.bfloat16)
        read = analysis.readout(moelens.wrap(half), seen[0][0, 2].bfloat16())
        assert read.dtype == torch.float32 and half.lm_head.weight.dtype == torch.bfloat16
        float_copy = copy.deepcopy(half).float()
        torch.testing.assert_close(read, float_copy.lm_head(getattr(float_copy.model, norm)(
            seen[0][0, 2].bfloat16().float())), rtol=1e-6, atol=1e-6)
    if family == "llama4":
        return  # no per-slot values: it runs every expert on pre-weighted inputs
    with torch.no_grad(), wrapped.trace(ids):
        outputs = wrapped.moes[-1].expert_outputs.save()
    with torch.no_grad():
        assert torch.equal(analysis.readout(wrapped, outputs[0, 2, 0]), hf.lm_head(final(outputs[0, 2, 0])))


def test_readout_inside_a_trace_leaves_the_model_s_run_and_refuses_vectors_it_cannot_read_out():
    """Inside a trace (of the wrapper, or given the transformers model the trace runs) its norm and head calls were
    taken for the model's own: a later lm_head.output read failed with nnsight's "already ran past it". They run with
    the trace stood down: the readout equals the one after the trace, and the model's logits read after it, and at
    each generation step, equal the plain model's."""
    hf = tiny_model("mixtral")
    wrapped, ids = moelens.wrap(hf, tokenizer=ascii_tokenizer()), torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        plain = hf(ids).logits
    for given in (wrapped, hf):
        with torch.no_grad(), wrapped.trace(ids):
            vector = wrapped.moes[0].routed_output[0, 0].save()
            inside = analysis.readout(given, vector).save()
            head = wrapped.lm_head.output.save()
        assert torch.equal(head, plain)
        with torch.no_grad():
            assert torch.equal(inside, analysis.readout(wrapped, vector))
            assert torch.equal(inside, hf.lm_head(hf.model.norm(vector)))
    settings = {"max_new_tokens": 3, "min_new_tokens": 3, "do_sample": False}
    with torch.no_grad(), wrapped.generate(ids, **settings) as tracer:
        steps, outputs, logits = list().save(), list().save(), list().save()
        for _ in tracer.iter[:3]:
            outputs.append(wrapped.moes[-1].mlp_output[0, -1])
            steps.append(analysis.readout(wrapped, outputs[-1]))
            logits.append(wrapped.lm_head.output[0, -1])
        tokens = tracer.result.save()
    with torch.no_grad():
        expected = hf.generate(ids, **settings, output_logits=True, return_dict_in_generate=True)
        assert torch.equal(tokens, expected.sequences) and len(steps) == 3
        assert torch.equal(torch.stack(logits), torch.cat(expected.logits))
        assert all(torch.equal(step, analysis.readout(wrapped, output)) for step, output in zip(steps, outputs))
    width = hf.config.hidden_size
    for hidden, match in [(torch.zeros(3, width + 1), rf"\[\.\.\., {width}\]\), got a tensor of shape \[3, {width + 1}\]"),
                          (torch.tensor(1.0), r"got a tensor of shape \[\]"), ([0.0] * width, "got list"),
                          (torch.zeros(width, dtype=torch.long), "floating-point vectors, got torch.int64")]:
        with pytest.raises(MoelensError, match=match):
            analysis.readout(wrapped, hidden)


def test_the_logit_lens_reads_through_a_final_norm_the_family_names():
    """lfm2_moe's last norm is `embedding_norm`: the lens must apply it (a trained norm is not all ones)."""
    hf = tiny_model("lfm2_moe")
    torch.manual_seed(3)
    with torch.no_grad():
        hf.model.embedding_norm.weight.uniform_(0.2, 3.0)
    wrapped = moelens.wrap(hf)
    lens = analysis.expert_logit_lens(wrapped, [[5, 6, 7, 8, 9, 10]], top=4, progress=False)
    assert lens.norm == "model.embedding_norm"
    with torch.no_grad():
        logits = hf.lm_head(hf.model.embedding_norm(lens.mean_outputs[0]))
    for expert in torch.nonzero(lens.counts[0]).flatten().tolist():
        assert lens.top_ids[0, expert].tolist() == logits[expert].topk(4).indices.tolist()


def test_plots_do_not_draw_experts_a_layer_lacks_or_skips_as_an_expert():
    from moelens.analysis.token_view import TokenRouting
    from moelens.analysis.usage import Usage

    plots = analysis.plots
    usage = Usage(layers=[0, 2], counts=torch.tensor([[3, 1, 0, 0], [1, 1, 1, 1]]),
                  weight=torch.zeros(2, 4, dtype=torch.float64), tokens=4, top_k=[1, 1], num_experts=[2, 4])
    figure = plots.plot_usage(usage)
    cells = figure.axes[0].images[0].get_array()
    assert cells.mask[0, 2:].all() or torch.isnan(torch.as_tensor(cells.data[0, 2:])).all()
    assert len(figure.axes[0].texts) == 6  # 2 + 4 annotated cells, none for the experts layer 0 lacks
    view = TokenRouting(token_ids=torch.tensor([1, 2]), tokens=["a", "b"], layers=[0],
                        indices=torch.tensor([[[0, 1], [SKIPPED, SKIPPED]]]), weights=torch.ones(1, 2, 2))
    image = plots.plot_token_routing(view).axes[0].images[0]
    colours = image.to_rgba(image.get_array())
    assert tuple(colours[0, 1]) == (1.0, 1.0, 1.0, 1.0)  # the skipped token is white, no expert's colour
    for known in ([8], []):  # E given, or only the router's scores of 8 experts
        image = plots.plot_token_routing(TokenRouting(view.token_ids, view.tokens, view.layers, view.indices,
                                                      view.weights, torch.zeros(1, 2, 8), known)).axes[0].images[0]
        assert image.get_clim() == (-0.5, 7.5)  # every expert of the layer, whichever the text uses
    # zaya's router scores a skip class past its E experts: no colour (nor colour-bar tick) for an expert 8
    view = analysis.token_routing(moelens.wrap(tiny_model("zaya")), [5, 6, 7, 8, 9, 10, 11, 12])
    assert view.probs.shape[-1] == 9 and view.num_experts == [8] * len(view.layers)
    assert plots.plot_token_routing(view).axes[0].images[0].get_clim() == (-0.5, 7.5)


def test_plots_stay_readable_at_real_expert_and_layer_counts(tmp_path):
    """DeepSeek-V3 sizes (256 experts, 58 MoE layers): usage.png was 140 inches wide (0.55 in per expert, for
    labels it no longer drew past 16 experts) and entropy.png's 58-entry legend covered the plot."""
    from moelens.analysis.entropy import Entropy
    from moelens.analysis.usage import Usage

    plots = analysis.plots
    layers, experts = list(range(3, 61)), 256
    counts = torch.randint(0, 50, (len(layers), experts), generator=torch.Generator().manual_seed(0))
    usage = Usage(layers=layers, counts=counts, weight=torch.zeros(len(layers), experts, dtype=torch.float64),
                  tokens=1000, top_k=[8] * len(layers), num_experts=[experts] * len(layers))
    figure = plots.plot_usage(usage)
    width, height = figure.get_size_inches()
    assert width <= 14 and height <= 12 and not figure.axes[0].texts
    assert "annotations" not in figure.axes[0].get_title()
    plots.save(figure, tmp_path / "usage.png")

    histogram = torch.randint(0, 20, (len(layers), 20), generator=torch.Generator().manual_seed(1))
    entropy = Entropy(layers=layers, source="router", mean=torch.rand(len(layers)), histogram=histogram,
                      edges=torch.linspace(0, 1, 21), tokens=1000)
    figure = plots.plot_entropy(entropy)
    curves, means = figure.axes[0], figure.axes[1]
    assert curves.get_legend() is None and len(curves.lines) == len(layers)
    assert len({line.get_color() if isinstance(line.get_color(), str) else tuple(line.get_color())
                for line in curves.lines}) == len(layers)  # one colour per layer, not a 10-colour cycle
    assert means.lines[0].get_xdata().tolist() == layers
    torch.testing.assert_close(torch.tensor(means.lines[0].get_ydata(), dtype=torch.float32), entropy.mean)
    few = Entropy(layers=layers[:3], source="router", mean=entropy.mean[:3], histogram=histogram[:3],
                  edges=entropy.edges, tokens=1000)
    assert len(plots.plot_entropy(few).axes[0].get_legend().get_texts()) == 3


def _two_expert_usage():
    """One layer's usage of two experts, enough to plot (for the tests of plots.save)."""
    from moelens.analysis.usage import Usage

    return Usage(layers=[0], counts=torch.tensor([[3, 1]]), weight=torch.zeros(1, 2, dtype=torch.float64), tokens=2,
                 top_k=[2], num_experts=[2])


def test_plots_save_writes_the_format_its_path_names_and_always_closes(tmp_path, monkeypatch):
    """save returned a path with no suffix where matplotlib had written '<path>.png', named '~' a folder, and left
    the figure open when matplotlib refused the path."""
    import matplotlib.pyplot as plt

    plots = analysis.plots
    usage = _two_expert_usage()
    written = plots.save(plots.plot_usage(usage), tmp_path / "usage")
    assert written == tmp_path / "usage.png" and written.read_bytes().startswith(b"\x89PNG")
    assert plots.save(plots.plot_usage(usage), tmp_path / "usage.pdf").read_bytes().startswith(b"%PDF")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert plots.save(plots.plot_usage(usage), "~/plots/usage.png") == tmp_path / "home" / "plots" / "usage.png"
    (tmp_path / "a-file").write_text("kept\n")
    before = len(plt.get_fignums())
    for path, match in ((tmp_path / "usage.docx", r"cannot save a plot as 'usage.docx': matplotlib writes .*png"),
                        (tmp_path / "a-file" / "usage.png", r"lies under .*a-file', which is a file")):
        with pytest.raises(MoelensError, match=match):
            plots.save(plots.plot_usage(usage), path)
        assert len(plt.get_fignums()) == before
    assert (tmp_path / "a-file").read_text() == "kept\n"


def test_plots_save_refuses_a_folder_and_leaves_the_file_beside_it(tmp_path):
    """save(fig, "outdir") with outdir a folder wrote outdir.png beside it, over the user's file of that name, and
    save(fig, "isdir.png") with isdir.png a folder raised matplotlib's IsADirectoryError."""
    plots = analysis.plots
    usage = _two_expert_usage()
    (tmp_path / "outdir").mkdir()
    (tmp_path / "outdir.png").write_text("the user's notes\n")
    (tmp_path / "isdir.png").mkdir()
    (tmp_path / "bare").write_text("")
    (tmp_path / "bare.png").mkdir()
    for path, folder in (("outdir", "outdir"), ("isdir.png", "isdir.png"), ("bare", "bare.png")):
        with pytest.raises(MoelensError, match=rf"cannot save a plot to .*{path}: .*{folder} is a folder; name a file"):
            plots.save(plots.plot_usage(usage), tmp_path / path)
    assert (tmp_path / "outdir.png").read_text() == "the user's notes\n"
    assert not any((tmp_path / "outdir").iterdir()) and not any((tmp_path / "isdir.png").iterdir())


class _Spelled:
    """An os.PathLike keeping the path as typed (a pathlib.Path drops a trailing slash)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __fspath__(self) -> str:
        return self.path


def test_plots_save_refuses_a_symbolic_link_and_a_path_ending_in_a_slash(tmp_path):
    """save(fig, "usage.png") with usage.png a link to the user's notes.txt wrote the PNG over notes.txt, and
    save(fig, "x.png/") (a folder, by its slash) wrote the file x.png: moelens writes through no link, as export."""
    plots = analysis.plots
    (tmp_path / "notes.txt").write_text("the user's notes\n")
    (tmp_path / "usage.png").symlink_to(tmp_path / "notes.txt")
    with pytest.raises(MoelensError, match=r"cannot save a plot to .*usage\.png: it is a symbolic link \(to .*notes"
                                           r"\.txt'\); moelens writes through no link"):
        plots.save(plots.plot_usage(_two_expert_usage()), tmp_path / "usage.png")
    for spelled in (f"{tmp_path}/x.png/", f"{tmp_path}/x.png/.", f"{tmp_path}/x.png/..", _Spelled(f"{tmp_path}/x.png/")):
        with pytest.raises(MoelensError, match=r"x\.png/(\.\.?)?': a path ending in '/', '/\.' or '/\.\.' names a "
                                               r"folder; name a file"):
            plots.save(plots.plot_usage(_two_expert_usage()), spelled)
    assert (tmp_path / "notes.txt").read_text() == "the user's notes\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["notes.txt", "usage.png"]


def test_plots_save_refuses_a_hard_link_and_takes_long_names(tmp_path):
    """plots.save wrote into the file at its path: a hard link of the user's notes.txt got the PNG."""
    import os

    plots = analysis.plots
    (tmp_path / "notes.txt").write_text("the user's notes\n")
    os.link(tmp_path / "notes.txt", tmp_path / "hard.png")
    with pytest.raises(MoelensError, match=r"hard\.png: it is a hard link of a file with another name too"):
        plots.save(plots.plot_usage(_two_expert_usage()), tmp_path / "hard.png")
    assert (tmp_path / "notes.txt").read_text() == "the user's notes\n"
    long = tmp_path / f"{'x' * 246}.png"  # as long a name as the folder takes
    assert plots.save(plots.plot_usage(_two_expert_usage()), long).read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["hard.png", "notes.txt", long.name])


def test_plots_save_refuses_a_file_it_may_not_write_and_one_that_is_no_regular_file(tmp_path, monkeypatch):
    """A plot the user had made read-only, and a named pipe, were written over (the pipe waited for a reader); a
    writable file in a folder this user may not write into was refused as lying under it. What this user may not
    write is simulated (os.access, may_write_into): root writes anything."""
    import os

    from moelens.analysis import plots as plots_module

    plots = analysis.plots
    kept = tmp_path / "kept.png"
    kept.write_bytes(b"the user's plot")
    (tmp_path / "mine.png").write_bytes(b"the user's earlier plot, theirs to write")
    monkeypatch.setattr(plots_module.os, "access", lambda path, mode: str(path) != str(kept))
    with pytest.raises(MoelensError, match=r"kept\.png: it is a file this user may not write; make it writable"):
        plots.save(plots.plot_usage(_two_expert_usage()), kept)
    monkeypatch.undo()
    from moelens import paths

    # a folder this user may not write into: a new file there is refused, a file of theirs there is written in place
    monkeypatch.setattr(paths, "may_write_into", lambda folder: folder != tmp_path)
    written = plots.save(plots.plot_usage(_two_expert_usage()), tmp_path / "mine.png")
    assert written.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(MoelensError, match=r"new\.png: it lies under .* a folder this user may not write into"):
        plots.save(plots.plot_usage(_two_expert_usage()), tmp_path / "new.png")
    monkeypatch.undo()
    os.mkfifo(tmp_path / "pipe.png")
    with pytest.raises(MoelensError, match=r"pipe\.png: it is no regular file \(a pipe or a device\)"):
        plots.save(plots.plot_usage(_two_expert_usage()), tmp_path / "pipe.png")
    assert kept.read_bytes() == b"the user's plot" and (tmp_path / "pipe.png").is_fifo()


@pytest.mark.parametrize(("chosen", "expected"), [("", "agg"), ("svg", "svg"), ("pdf", "pdf")])
def test_plots_pick_agg_without_a_display_only_where_the_user_chose_no_backend(chosen, expected):
    """The first plot on a machine without a display switched a backend the user had chosen (matplotlib.use("svg"))
    to Agg. Run in a fresh interpreter: the choice is made before pyplot is first imported."""
    import os
    import subprocess
    import sys

    script = (
        "import matplotlib, torch\n"
        f"if {chosen!r}: matplotlib.use({chosen!r})\n"
        "from moelens.analysis import plots\n"
        "from moelens.analysis.usage import Usage\n"
        "usage = Usage(layers=[0], counts=torch.tensor([[3, 1]]), weight=torch.zeros(1, 2, dtype=torch.float64), "
        "tokens=2, top_k=[2], num_experts=[2])\n"
        "plots.plot_usage(usage)\n"
        "print(matplotlib.get_backend().lower())\n"
    )
    env = {name: value for name, value in os.environ.items() if name not in ("DISPLAY", "WAYLAND_DISPLAY", "MPLBACKEND")}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-1] == expected


@pytest.mark.parametrize(("path", "refusal"), [
    (".", r"cannot save a plot to \.: \. is a folder; name a file \(such as plot\.png\)"),
    ("./", r"cannot save a plot to \.: \. is a folder; name a file \(such as plot\.png\)"),
    ("", r"path is empty: name a file or folder \(an empty path would be the working folder\)"),
])
def test_plots_save_refuses_the_current_folder(tmp_path, monkeypatch, path, refusal):
    """save(fig, ".") (or "" / "./") raised pathlib's "PosixPath('.') has an empty name" before the folder check."""
    monkeypatch.chdir(tmp_path)
    plots = analysis.plots
    with pytest.raises(MoelensError, match=refusal):
        plots.save(plots.plot_usage(_two_expert_usage()), path)
    assert not any(tmp_path.iterdir())


def _run_docs_example(page: str, holding: str, folder, names: dict) -> dict:
    """Run the python block of docs/``page`` holding ``holding``, as written there, with ``names`` defined (from a
    file in ``folder``: nnsight reads a trace's body from its source); its names after the run."""
    import re
    import runpy
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / page).read_text()
    script = folder / f"{Path(page).stem}_example.py"
    script.write_text(next(block for block in re.findall(r"```python\n(.*?)```", text, re.S) if holding in block))
    return runpy.run_path(str(script), init_globals=names)


def test_docs_steermoe_and_pruning_examples_pick_each_layers_own_experts(capsys, tmp_path):
    """docs/analysis.md's SteerMoE example and docs/interventions.md's pruning recipe, run as written on a converted
    model whose layers have 4 and 8 experts: the argmax of risk_difference named expert 4 of the 4-expert layer
    (its rows past 3 are NaN, which argmax ranks highest), and the recipe's argsort over usage.counts picked the
    zero columns past layer 0's experts, so ablate refused expert 4. Ground truth: routing read with forward pre-hooks
    on the experts of an unwrapped copy, counted by hand, and the pruned logits of that copy with the pruned experts'
    router bias at -inf (route_around's -inf logit)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from moelens.compress import tomoe

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    calibration = torch.randint(32, 127, (8, 16))
    converted = tomoe(LlamaForCausalLM(config).eval(), num_experts=4, top_k=2, calibration=calibration,
                      max_error=None, target_modules=["model.layers.0.mlp"], progress=False)
    converted = tomoe(converted, num_experts=8, top_k=2, calibration=calibration, max_error=None,
                      target_modules=["model.layers.1.mlp"], progress=False)
    reference, tokenizer = copy.deepcopy(converted), ascii_tokenizer()
    model = moelens.wrap(converted, tokenizer=tokenizer)
    blocks = {0: reference.model.layers[0].mlp, 1: reference.model.layers[1].mlp}

    def routed(text: str) -> dict[int, list[list[int]]]:
        """Each layer's experts per token of ``text``, tokenized as the corpus is (no special tokens)."""
        seen: dict[int, list[list[int]]] = {}
        hooks = [block.experts.register_forward_pre_hook(lambda module, args, layer=layer: seen.update(
            {layer: args[1].tolist()})) for layer, block in blocks.items()]
        with torch.no_grad():
            reference(torch.tensor([tokenizer(text, add_special_tokens=False).input_ids]))
        for hook in hooks:
            hook.remove()
        return seen

    steer = _run_docs_example("analysis.md", "spec.risk_difference(\"harmful\", \"benign\")", tmp_path,
                              {"analysis": analysis, "plots": analysis.plots, "model": model})
    analysis.plots.pyplot().close("all")
    picked = [int(expert) for expert in capsys.readouterr().out.split("tensor([")[-1].split("])")[0].split(",")]
    for row, layer in enumerate(blocks):
        rates = []
        for text in steer["texts"]:  # harmful, benign
            tokens = routed(text)[layer]
            rates.append([sum(expert in chosen for chosen in tokens) / len(tokens) for expert in range(8)])
        own = converted.model.layers[layer].mlp.num_experts
        difference = [rates[0][expert] - rates[1][expert] for expert in range(own)]
        assert picked[row] < own and difference[picked[row]] == max(difference), (layer, picked, difference)

    prompt = "import os\nprint(os.path"
    with model.trace(prompt):
        clean = model.output.logits[0, -1].softmax(-1).save()
    prune = _run_docs_example("interventions.md", "moelens.ablate(moe, experts, \"route_around\")", tmp_path,
                              {"moelens": moelens, "model": model, "prompt": prompt, "clean": clean})
    for row, (layer, block) in enumerate(blocks.items()):
        counts = Counter(expert for text in [prompt, "The sum of two numbers."] for chosen in routed(text)[layer]
                         for expert in chosen)
        own = [counts[expert] for expert in range(block.experts.num_experts)]
        least = prune["least_used"][row].tolist()
        assert all(expert < len(own) for expert in least) and sorted(own[e] for e in least) == sorted(own)[:2], layer
        with torch.no_grad():
            block.router.bias[least] = float("-inf")
    with torch.no_grad():
        expected = reference(torch.tensor([tokenizer(prompt, add_special_tokens=False).input_ids])).logits[0, -1]
    torch.testing.assert_close(prune["pruned"], expected.softmax(-1))


def test_routing_agreement_of_a_route_around_edit(qwen):
    """An expert routed around in the last MoE layer (a lasting edit): no token keeps it there, and the layers before
    route as before; the shares equal a count over the two caches' indices by hand."""
    wrapped, hf, cache, truth = qwen
    last = wrapped.moes[-1]
    busiest = int(torch.bincount(cache.indices(last.layer).long().flatten()).argmax())
    with wrapped.edit(inplace=True):
        moelens.ablate(wrapped.moes[-1], busiest, "route_around")
    try:
        edited = analysis.collect_routing(wrapped, TEXTS, batch_size=2, max_length=MAX_LENGTH, shard_tokens=7,
                                          progress=False)
    finally:
        wrapped.clear_edits()
    agreement = analysis.routing_agreement(cache, edited)
    assert agreement.layers == cache.layers and agreement.tokens == cache.num_tokens
    assert agreement.top1[:-1].tolist() == agreement.same_set[:-1].tolist() == [1.0] * (len(cache.layers) - 1)
    assert float(agreement.kept[-1, busiest]) == 0.0 and float(agreement.same_set[-1]) < 1
    before = [set(row) for row in cache.indices(last.layer).tolist()]
    after = [set(row) for row in edited.indices(last.layer).tolist()]
    assert busiest not in set().union(*after)
    assert math.isclose(agreement.same_set[-1], sum(a == b for a, b in zip(before, after)) / len(before))
    assert math.isclose(agreement.jaccard[-1], sum(len(a & b) / len(a | b) for a, b in zip(before, after)) / len(before))
