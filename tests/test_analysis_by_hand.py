"""Routing analysis on tiny hand-made caches, against numbers worked out by hand.

Ground truth: a few tokens' experts and weights written out in the test, and the
counts, probabilities, entropies and histogram bins computed from them with plain
Python loops and ``math`` (no moelens code, no torch reductions).
"""

from __future__ import annotations

import copy
import math
from collections import Counter

import pytest
import torch

import moelens
from moelens import analysis

#: Layer 0 (E = 4, k = 2) of two shards of tokens: each row the two experts a token chose.
CHOSEN = [[[0, 1], [0, 2], [0, 3]], [[1, 2], [0, 1]]]
WIDTH = 4


def shard_of(indices: list[list[int]], weights: list[list[float]], start: int = 0,
             logits: list[list[float]] | None = None) -> analysis.Shard:
    count = len(indices)
    return analysis.Shard(
        token_ids=torch.arange(start, start + count, dtype=torch.int32), text_index=torch.zeros(count, dtype=torch.int32),
        position=torch.arange(start, start + count, dtype=torch.int32),
        indices={0: torch.tensor(indices, dtype=torch.int16)}, weights={0: torch.tensor(weights, dtype=torch.float16)},
        logits={} if logits is None else {0: torch.tensor(logits, dtype=torch.float32)},
    )


def cache_of(shards: list[analysis.Shard], k: int = 2, has_logits: bool = False) -> analysis.RoutingCache:
    return analysis.RoutingCache(layers=[0], num_experts={0: WIDTH}, top_k={0: k}, score={0: "softmax"}, num_texts=1,
                                 has_logits=has_logits, _memory=shards)


def chosen_cache() -> analysis.RoutingCache:
    shards, start = [], 0
    for rows in CHOSEN:
        shards.append(shard_of(rows, [[0.5, 0.5]] * len(rows), start))
        start += len(rows)
    return cache_of(shards)


def tokens_by_hand() -> list[list[int]]:
    return [row for rows in CHOSEN for row in rows]


# -- usage ---------------------------------------------------------------------------------------------


def test_token_fraction_is_the_share_of_tokens_using_each_expert():
    """token_fraction[e] = (tokens routed to e) / tokens, so a row sums to k (not to 1).

    Guards against token_fraction dividing by the layer's slot count (a copy of `fraction`).
    """
    usage = analysis.expert_usage(chosen_cache())
    tokens = tokens_by_hand()
    assert usage.tokens == len(tokens) == 5
    using = [sum(expert in row for row in tokens) for expert in range(WIDTH)]  # [4, 3, 2, 1]
    assert usage.counts[0].tolist() == using
    expected = [count / len(tokens) for count in using]  # [0.8, 0.6, 0.4, 0.2]
    for actual, wanted in zip(usage.token_fraction[0].tolist(), expected):
        assert math.isclose(actual, wanted, rel_tol=1e-12)
    assert math.isclose(float(usage.token_fraction[0].sum()), 2.0, rel_tol=1e-12)  # k
    for actual, wanted in zip(usage.fraction[0].tolist(), [count / (2 * len(tokens)) for count in using]):
        assert math.isclose(actual, wanted, rel_tol=1e-12)  # fraction: rows sum to 1


# -- co-activation ------------------------------------------------------------------------------------


def test_lift_is_the_joint_over_the_product_of_the_marginals():
    """lift[i, j] = P(i and j) / (P(i) P(j)), with each probability counted over the tokens by hand.

    Guards against the denominator being P(i)^2 (a broadcast of the wrong axis): the marginals here differ.
    """
    tokens = tokens_by_hand()
    n = len(tokens)
    marginal = [sum(expert in row for row in tokens) / n for expert in range(WIDTH)]
    joint = [[sum(i in row and j in row for row in tokens) / n for j in range(WIDTH)] for i in range(WIDTH)]
    result = analysis.coactivation(chosen_cache(), 0)
    assert result.tokens == n
    assert result.counts.tolist() == [[round(joint[i][j] * n) for j in range(WIDTH)] for i in range(WIDTH)]
    lift = result.lift()
    for i in range(WIDTH):
        for j in range(WIDTH):
            expected = joint[i][j] / (marginal[i] * marginal[j])
            assert math.isclose(float(lift[i, j]), expected, rel_tol=1e-12), (i, j)
    # e.g. experts 0 and 1: together on 2 of 5 tokens, 0 on 4, 1 on 3: (2/5) / (4/5 * 3/5) = 5/6
    assert math.isclose(float(lift[0, 1]), 5 / 6, rel_tol=1e-12)
    assert math.isclose(float(lift[1, 0]), 5 / 6, rel_tol=1e-12)


# -- entropy histogram ---------------------------------------------------------------------------------


def entropy_by_hand(p: list[float]) -> float:
    total = sum(p)
    p = [x / total for x in p]
    return -sum(x * math.log(x) for x in p if x > 0) / math.log(len(p))


@pytest.mark.parametrize("bins", [10, 4])
def test_entropy_histogram_puts_each_token_in_the_bin_of_its_entropy(bins):
    """A token of normalised entropy e is counted in bin floor(e * bins) (e = 1 in the last bin).

    Guards against the bins being scaled by bins - 1 (every token one bin low past the first).
    """
    weights = [[0.9, 0.1], [0.7, 0.3], [0.6, 0.4], [0.5, 0.5], [1.0, 0.0]]
    # the weights are cached in float16: compute the entropies from what is stored
    stored = [[float(torch.tensor(w, dtype=torch.float16)) for w in row] for row in weights]
    entropies = [entropy_by_hand(row) for row in stored]  # about 0.469, 0.881, 0.971, 1, 0
    expected = [0] * bins
    for entropy in entropies:
        expected[min(math.floor(entropy * bins), bins - 1)] += 1
    cache = cache_of([shard_of([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2]], weights)])
    result = analysis.routing_entropy(cache, "weights", bins=bins)
    assert result.histogram[0].tolist() == expected
    assert math.isclose(float(result.mean[0]), sum(entropies) / len(entropies), rel_tol=1e-9)
    assert result.edges.tolist() == pytest.approx([i / bins for i in range(bins + 1)])
    if bins == 10:
        assert expected == [1, 0, 0, 0, 1, 0, 0, 0, 1, 2]


def test_a_token_of_nan_entropy_is_in_no_histogram_bin():
    """Weights the model computed as NaN (a broken expert upstream) gave a NaN entropy that the cast to a bin index
    put in bin 0, the "certain" end, while the mean said NaN. Ground truth: the finite tokens' bins by hand."""
    weights = [[0.9, 0.1], [float("nan"), float("nan")], [0.5, 0.5]]
    cache = cache_of([shard_of([[0, 1], [1, 2], [2, 3]], weights)])
    result = analysis.routing_entropy(cache, "weights", bins=4)
    stored = [[float(torch.tensor(w, dtype=torch.float16)) for w in row] for row in (weights[0], weights[2])]
    expected = [0] * 4
    for entropy in map(entropy_by_hand, stored):
        expected[min(math.floor(entropy * 4), 3)] += 1
    assert result.histogram[0].tolist() == expected and sum(expected) == 2 and result.tokens == 3
    assert math.isnan(float(result.mean[0]))


def test_router_entropy_histogram_by_hand():
    """The router source: entropy of softmax(logits) over all E experts / log E, binned by hand."""
    probabilities = [[0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25], [0.97, 0.01, 0.01, 0.01], [0.4, 0.3, 0.2, 0.1]]
    logits = [[math.log(p) for p in row] for row in probabilities]
    entropies = [entropy_by_hand(row) for row in probabilities]  # about 0.678, 1, 0.121, 0.923
    bins = 10
    expected = [0] * bins
    for entropy in entropies:
        expected[min(math.floor(entropy * bins), bins - 1)] += 1
    assert expected == [0, 1, 0, 0, 0, 0, 1, 0, 0, 2]
    cache = cache_of([shard_of([[0, 1]] * 4, [[0.5, 0.5]] * 4, logits=logits)], has_logits=True)
    result = analysis.routing_entropy(cache, "router", bins=bins)
    assert result.histogram[0].tolist() == expected
    assert math.isclose(float(result.mean[0]), sum(entropies) / len(entropies), rel_tol=1e-6)


# -- entropy: the router's softcap -----------------------------------------------------------------------


def test_router_entropy_applies_the_routers_softcap_before_the_softmax():
    """A layer with a logit softcap c scores softmax(tanh(l / c) * c): its entropy is that distribution's.

    Guards against the softcap being dropped (softmax of the raw logits, far sharper at these magnitudes).
    """
    cap = 5.0
    logits = [[20.0, 0.0, -5.0, 3.0], [15.0, 9.0, -30.0, 0.0], [40.0, -40.0, 8.0, 1.0]]

    def capped_softmax(row: list[float]) -> list[float]:
        capped = [math.tanh(x / cap) * cap for x in row]
        top = max(capped)
        exp = [math.exp(x - top) for x in capped]
        return [x / sum(exp) for x in exp]

    entropies = [entropy_by_hand(capped_softmax(row)) for row in logits]
    raw = [entropy_by_hand([math.exp(x - max(row)) for x in row]) for row in logits]
    assert all(abs(a - b) > 0.1 for a, b in zip(entropies, raw))  # the cap matters here
    bins = 10
    expected = [0] * bins
    for entropy in entropies:
        expected[min(math.floor(entropy * bins), bins - 1)] += 1
    cache = cache_of([shard_of([[0, 1]] * 3, [[0.5, 0.5]] * 3, logits=logits)], has_logits=True)
    cache.softcap = {0: cap}
    result = analysis.routing_entropy(cache, "router", bins=bins)
    assert result.histogram[0].tolist() == expected
    assert math.isclose(float(result.mean[0]), sum(entropies) / len(entropies), rel_tol=1e-6)
    per_token = analysis.token_entropy(cache, 0, "router").tolist()
    for actual, wanted in zip(per_token, entropies):
        assert math.isclose(actual, wanted, rel_tol=1e-6, abs_tol=1e-9)


# -- specialisation --------------------------------------------------------------------------------------


def test_specialisation_counts_shares_and_default_classes_by_hand():
    """counts[e, c] = slots of class-c tokens routed to e; share() = P(class | expert) and expert_share()
    = P(expert | class), both from a Counter of (expert, class) pairs; with no class names the classes
    are 0 .. the largest label (the largest included).

    Guards against expert_share dividing along the wrong axis and the default classes dropping the last.
    """
    labels = [0, 1, 2, 1, 0]  # one per token of CHOSEN
    pairs = Counter((expert, label) for row, label in zip(tokens_by_hand(), labels) for expert in row)
    result = analysis.specialisation(chosen_cache(), torch.tensor(labels))
    assert result.classes == ["0", "1", "2"]
    expected = [[pairs[(e, c)] for c in range(3)] for e in range(WIDTH)]
    assert result.counts[0].tolist() == expected
    by_expert = [sum(expected[e]) for e in range(WIDTH)]
    by_class = [sum(expected[e][c] for e in range(WIDTH)) for c in range(3)]
    share, expert_share = result.share()[0], result.expert_share()[0]
    for e in range(WIDTH):
        for c in range(3):
            assert math.isclose(float(share[e, c]), expected[e][c] / by_expert[e], rel_tol=1e-12), (e, c)
            assert math.isclose(float(expert_share[e, c]), expected[e][c] / by_class[c], rel_tol=1e-12), (e, c)
    # class 2 is one token (experts 0 and 3): half its slots on each
    assert float(expert_share[0, 2]) == 0.5 and float(expert_share[3, 2]) == 0.5


def test_specialisation_refuses_labels_equal_to_the_class_count():
    """With C named classes, a label C (one past the last) is never another expert's class 0, nor dropped unseen (a
    class of 1-based labels lost): it is refused; 255 and -1 leave their tokens out."""
    with pytest.raises(moelens.MoelensError, match=r"labels\[1\] is 2, no class id of classes=\['a', 'b'\]"):
        analysis.specialisation(chosen_cache(), torch.tensor([0, 2, 1, 255, 2]), classes=["a", "b"])
    labels = [0, -1, 1, 255, 255]  # tokens 1, 3 and 4 are unlabelled
    result = analysis.specialisation(chosen_cache(), torch.tensor(labels), classes=["a", "b"])
    pairs = Counter((expert, label) for row, label in zip(tokens_by_hand(), labels) if 0 <= label < 2 for expert in row)
    assert result.counts[0].tolist() == [[pairs[(e, c)] for c in range(2)] for e in range(WIDTH)]
    assert int(result.counts.sum()) == 2 * 2  # two labelled tokens, k = 2 slots each


def test_activation_rate_and_risk_difference_by_hand():
    """activation_rate()[e, c] = the share of class-c tokens whose experts include e (tokens with every slot skipped
    not counted, an expert in two slots of a token counted once), risk_difference(a, b) = rate of a minus rate of b,
    NaN for a class with no routed token; counted with Python loops over the rows."""
    rows = [[0, 1], [0, 2], [0, 3], [1, 2], [-1, -1], [2, 3], [3, 3]]  # token 4: both slots skipped (SKIPPED is
    labels = [0, 0, 1, 1, 1, 0, 1]  # -1); token 6: expert 3 in both slots (a swap to a used expert), reached once
    assert analysis.cache.SKIPPED == -1
    result = analysis.specialisation(cache_of([shard_of(rows, [[0.5, 0.5]] * len(rows))]), torch.tensor(labels),
                                     classes=["harmful", "benign", "empty"])
    routed = [(row, label) for row, label in zip(rows, labels) if any(e >= 0 for e in row)]
    tokens = [sum(label == c for _, label in routed) for c in range(3)]
    assert result.tokens[0].tolist() == tokens == [3, 3, 0]
    rate = result.activation_rate()[0]
    for e in range(WIDTH):
        for c in range(2):
            assert math.isclose(float(rate[e, c]), sum(e in row for row, label in routed if label == c) / tokens[c],
                                rel_tol=1e-12), (e, c)
        assert math.isnan(float(rate[e, 2]))
    difference = result.risk_difference("harmful", 1)[0]
    for e in range(WIDTH):
        assert math.isclose(float(difference[e]), float(rate[e, 0]) - float(rate[e, 1]), abs_tol=1e-12)
    assert difference.tolist() == [2 / 3 - 1 / 3, 1 / 3 - 1 / 3, 2 / 3 - 1 / 3, 1 / 3 - 2 / 3]
    with pytest.raises(moelens.MoelensError, match=r"no class 'toxic': the classes are \['harmful', 'benign', "
                                                   r"'empty'\]"):
        result.risk_difference("toxic", "benign")
    with pytest.raises(moelens.MoelensError, match="holds no token counts"):
        analysis.Specialisation([0], ["a"], result.counts[..., :1]).activation_rate()


def test_specialisation_labels_given_as_class_names_count_as_their_ids():
    """labels as names (["code", "prose", ...]): the classes are the names in the order they first appear, or their
    places in classes=; counts per (expert, class) from a Counter over the rows; a name not in classes is refused."""
    names = ["prose", "code", "code", "prose", "code"]  # one per token of CHOSEN
    pairs = Counter((expert, label) for row, label in zip(tokens_by_hand(), names) for expert in row)
    result = analysis.specialisation(chosen_cache(), names)
    assert result.classes == ["prose", "code"]
    assert result.counts[0].tolist() == [[pairs[(e, c)] for c in ["prose", "code"]] for e in range(WIDTH)]
    ordered = analysis.specialisation(chosen_cache(), names, classes=["code", "prose", "other"])
    assert ordered.counts[0].tolist() == [[pairs[(e, c)] for c in ["code", "prose", "other"]] for e in range(WIDTH)]
    with pytest.raises(moelens.MoelensError, match=r"labels name the class 'prose', which is not in "
                                                   r"classes=\['code'\]; add it there"):
        analysis.specialisation(chosen_cache(), names, classes=["code"])


class SpelledTokenizer:
    """Decodes the token ids of `chosen_cache` (0 .. 4) to fixed texts, as SentencePiece does: token 1 is the word
    start "▁7", which decoded alone loses its space; counts its calls."""

    TEXTS = {0: "ab", 1: " 7", 2: ",", 3: "cd", 4: " "}  # each token's text in running text
    PIECES = {0: "ab", 1: "▁7", 2: ",", 3: "cd", 4: "▁"}
    DECODED = {0: "ab", 1: "7", 2: ",", 3: "cd", 4: " "}  # each id decoded alone: the word start loses its space

    def __init__(self) -> None:
        self.calls = 0

    def decode(self, ids: list[int]) -> str:
        self.calls += 1
        return "".join(self.DECODED[i] for i in ids)

    def convert_ids_to_tokens(self, token: int) -> str:
        return self.PIECES[token]


def kind_of(text: str) -> str | None:
    text = text.strip()
    return None if not text else "digit" if text.isdigit() else "letters" if text.isalpha() else "punctuation"


def test_specialisation_labels_given_as_a_function_of_each_token_s_text():
    """labels=function: each token labelled by its decoded text (a Counter by hand of the classes kind_of gives the
    tokens' texts), the function called once per distinct id, None leaving a token out, ids taken as ids; refused
    without a tokenizer, for per="text", for names mixed with ids, for a label that is neither, and for a name
    classes= lacks."""
    cache = chosen_cache()
    tokens = cache.token_ids().tolist() * 2  # each id twice: the function runs once per id
    cache = cache_of([shard_of(tokens_by_hand() * 2, [[0.5, 0.5]] * 10)])
    cache._memory[0].token_ids = torch.tensor(tokens, dtype=torch.int32)
    cache.tokenizer = tokenizer = SpelledTokenizer()
    names = [kind_of(SpelledTokenizer.TEXTS[token]) for token in tokens]
    pairs = Counter((expert, name) for row, name in zip(tokens_by_hand() * 2, names) if name for expert in row)
    seen = []
    result = analysis.specialisation(cache, lambda text: seen.append(text) or kind_of(text))
    assert result.classes == ["letters", "digit", "punctuation"] and tokenizer.calls == 5
    assert seen == [SpelledTokenizer.TEXTS[token] for token in range(5)]  # " 7" with its word-start space
    assert result.counts[0].tolist() == [[pairs[(e, c)] for c in result.classes] for e in range(WIDTH)]
    assert int(result.counts.sum()) == 2 * 8  # the two " " tokens are left out
    ordered = analysis.specialisation(cache, kind_of, classes=["digit", "punctuation", "letters", "other"])
    assert ordered.counts[0].tolist() == [[pairs[(e, c)] for c in ordered.classes] for e in range(WIDTH)]
    by_id = analysis.specialisation(cache, lambda text: len(text) - 1 if text.strip() else None)  # ids 1, 1, 0, 1
    lengths = [len(SpelledTokenizer.TEXTS[token]) - 1 if SpelledTokenizer.TEXTS[token].strip() else None
               for token in tokens]
    counted = Counter((expert, n) for row, n in zip(tokens_by_hand() * 2, lengths) if n is not None for expert in row)
    assert by_id.counts[0].tolist() == [[counted[(e, c)] for c in range(2)] for e in range(WIDTH)]
    refusals = {
        r"this cache has no tokenizer .*RoutingCache\.load\(folder, tokenizer=model\.tokenizer\)":
            (chosen_cache(), kind_of, {}),
        r"per=\"text\" takes one label per corpus item": (cache, kind_of, {"per": "text"}),
        r"class names for some tokens and class ids for others": (cache, lambda text: 1 if "7" in text else "x", {}),
        r"the function gave 1\.5 for the token ',' \(id 2\); give a class name \(str\), a class id \(int\)":
            (cache, lambda text: 1.5 if text == "," else 0, {}),
        r"the function names the class 'letters', which is not in classes=\['digit', 'punctuation'\]":
            (cache, kind_of, {"classes": ["digit", "punctuation"]}),
        r"the function gave None for every token, leaving them all out": (cache, lambda text: None, {}),
    }
    for message, (given, function, settings) in refusals.items():
        with pytest.raises(moelens.MoelensError, match=message):
            analysis.specialisation(given, function, **settings)


def test_top_experts_rank_a_class_s_experts_by_the_asked_measure_by_hand():
    """top_experts(class, layer, n, by): the experts in order of the measure, from a Counter by hand (lift =
    P(class | expert) / P(class)), ties to the lower id, none for a class without slots; row(layer) and a short
    repr."""
    labels = [0, 1, 1, 0, 1]  # CHOSEN's tokens: 0 [0, 1], 1 [0, 2], 2 [0, 3], 3 [1, 2], 4 [0, 1]
    result = analysis.specialisation(chosen_cache(), torch.tensor(labels), classes=["a", "b", "empty"])
    pairs = Counter((expert, label) for row, label in zip(tokens_by_hand(), labels) for expert in row)
    slots = sum(pairs.values())
    lift = {e: (pairs[(e, 1)] / max(1, pairs[(e, 0)] + pairs[(e, 1)])) / (sum(pairs[(x, 1)] for x in range(WIDTH)) /
                                                                         slots) for e in range(WIDTH)}
    by_hand = sorted(range(WIDTH), key=lambda e: (-lift[e], e))
    assert result.top_experts("b", 0, n=WIDTH) == by_hand and result.top_experts(1, 0) == by_hand[:3]
    assert result.top_experts("b", 0, n=1, by="share") == [max(range(WIDTH), key=lambda e: (
        pairs[(e, 1)] / max(1, pairs[(e, 0)] + pairs[(e, 1)]), -e))]
    assert result.top_experts("empty", 0, n=2, by="activation_rate") == [] == result.top_experts("empty", 0)
    assert result.row(0) == 0
    assert repr(result) == "Specialisation(layers=[0], classes=['a', 'b', 'empty'], experts=4, slots=10)"
    for bad, message in [({"by": "count"}, r"by='count' is not one of"), ({"n": 0}, r"n=0: give how many experts"),
                         ({"layer": 3}, r"layer 3 is not an MoE layer of this specialisation")]:
        with pytest.raises(moelens.MoelensError, match=message):
            result.top_experts("a", **{"layer": 0, **bad})


def test_activation_rate_of_a_layer_with_fewer_experts_leaves_the_missing_ones_out():
    """A converted model whose layer 1 has 2 experts where layer 0 has 4: the rates and risk differences past layer
    1's experts were 0 (an expert that exists and is never reached); they are NaN (no such expert), and plots leave
    the cells empty. Counted by hand over the rows."""
    rows = {0: [[0, 1], [2, 3], [0, 3]], 1: [[0, 1], [1, 0], [0, 1]]}
    labels = [0, 1, 0]
    shard = analysis.Shard(
        token_ids=torch.arange(3, dtype=torch.int32), text_index=torch.zeros(3, dtype=torch.int32),
        position=torch.arange(3, dtype=torch.int32),
        indices={layer: torch.tensor(chosen, dtype=torch.int16) for layer, chosen in rows.items()},
        weights={layer: torch.full((3, 2), 0.5, dtype=torch.float16) for layer in rows}, logits={})
    cache = analysis.RoutingCache(layers=[0, 1], num_experts={0: 4, 1: 2}, top_k={0: 2, 1: 2},
                                  score={0: "softmax", 1: "softmax"}, num_texts=1, has_logits=False, _memory=[shard])
    result = analysis.specialisation(cache, torch.tensor(labels), classes=["a", "b"])
    rate = result.activation_rate()
    for layer in (0, 1):
        for expert in range(cache.num_experts[layer]):
            for c in (0, 1):
                tokens = [row for row, label in zip(rows[layer], labels) if label == c]
                assert float(rate[layer, expert, c]) == sum(expert in row for row in tokens) / len(tokens)
    assert rate[1, 2:].isnan().all() and not rate[0].isnan().any()
    assert result.risk_difference("a", "b")[1, 2:].isnan().all()
    figure = analysis.plots.plot_risk_difference(result, "a", "b")
    cells = torch.as_tensor(figure.axes[0].images[0].get_array().filled(float("nan")))
    written = {text.get_position() for text in figure.axes[0].texts}
    analysis.plots.pyplot().close(figure)
    assert cells[1, 2:].isnan().all() and (2, 1) not in written and (3, 1) not in written


# -- top tokens ------------------------------------------------------------------------------------------


def test_top_tokens_by_share_keeps_a_token_seen_exactly_min_count_times():
    """by="share" leaves out tokens seen fewer than min_count times: one seen exactly min_count times stays;
    `total` is every slot of the expert (the left-out tokens' too), counted by hand."""
    token_ids = [7, 8, 7, 9, 8, 7]
    rows = [[0, 1], [0, 2], [0, 3], [0, 1], [1, 2], [2, 3]]
    shard = shard_of(rows, [[0.5, 0.5]] * len(rows))
    shard.token_ids = torch.tensor(token_ids, dtype=torch.int32)
    cache = cache_of([shard])
    seen = Counter(token_ids)
    assert seen[7] == 3
    served = Counter((expert, token) for row, token in zip(rows, token_ids) for expert in row)
    for expert in range(WIDTH):
        (result,) = analysis.top_tokens(cache, 0, [expert], n=10, by="share", min_count=3)
        kept = [token for token in seen if seen[token] >= 3 and served[(expert, token)]]
        assert sorted(result.token_ids.tolist()) == sorted(kept), expert
        for token, count, share in zip(result.token_ids.tolist(), result.counts.tolist(), result.share.tolist()):
            assert count == served[(expert, token)]
            assert math.isclose(share, served[(expert, token)] / seen[token], rel_tol=1e-12)
        assert result.total == sum(expert in row for row in rows), expert
    (zero,) = analysis.top_tokens(cache, 0, [0], by="share", min_count=3)
    assert zero.token_ids.tolist() == [7] and zero.total == 4  # tokens 7, 8, 7, 9: only 7 is seen 3 times
    # one line, naming the tokens with their counts and shares (expert 0 serves 2 of token 7's 3 occurrences)
    assert repr(zero) == f"ExpertTokens(layer 0, expert 0, 4 slots: {zero.tokens[0]!r} x2 (67%))"
    (wide,) = analysis.top_tokens(cache, 0, [0], n=10)  # by count: 7 x2, 8 x1, 9 x1
    assert repr(wide).count(" x") == 3 and "more" not in repr(wide)
    wide.tokens, wide.counts, wide.share = wide.tokens * 3, wide.counts.repeat(3), wide.share.repeat(3)
    assert repr(wide).endswith(", ... 4 more)") and repr(wide).count(" x") == 5
    (none,) = analysis.top_tokens(cache, 0, [3], by="share", min_count=4)  # no token is seen 4 times
    assert none.token_ids.numel() == 0 and repr(none) == "ExpertTokens(layer 0, expert 3, 2 slots: no token)"


# -- load balance: unused experts ------------------------------------------------------------------------


def test_unused_experts_are_those_with_no_slot_not_those_used_once():
    """unused = experts with a count of 0; CHOSEN uses expert 3 once (not unused), a cache of experts 0
    and 1 only leaves 2 unused."""
    using = [sum(expert in row for row in tokens_by_hand()) for expert in range(WIDTH)]
    assert using[3] == 1
    assert int(analysis.load_balance(chosen_cache()).unused[0]) == sum(count == 0 for count in using) == 0
    narrow = cache_of([shard_of([[0, 1], [1, 0], [0, 1]], [[0.5, 0.5]] * 3)])
    assert int(analysis.load_balance(narrow).unused[0]) == 2


# -- co-activation: an expert twice in one token ---------------------------------------------------------


def test_coactivation_counts_a_token_once_per_expert_however_many_slots_hold_it():
    """A token whose two slots both hold expert 1 is one token routed to 1: counts[i, j] = tokens whose set
    of experts holds i and j."""
    rows = [[1, 1], [0, 1], [2, 3]]
    cache = cache_of([shard_of(rows, [[0.5, 0.5]] * len(rows))])
    result = analysis.coactivation(cache, 0)
    sets = [set(row) for row in rows]
    assert result.counts.tolist() == [[sum(i in s and j in s for s in sets) for j in range(WIDTH)]
                                      for i in range(WIDTH)]
    assert int(result.counts[1, 1]) == 2 and int(result.counts[0, 1]) == 1
    alone = analysis.coactivation(cache_of([shard_of([[1, 1]], [[0.5, 0.5]])]), 0)
    assert int(alone.counts[1, 1]) == 1 and int(alone.counts.sum()) == 1


# -- expert logit lens, relative ------------------------------------------------------------------------


def test_relative_logit_lens_subtracts_the_count_weighted_layer_mean():
    """relative=True reads out mean_e - (sum of every slot's weighted output) / (slots): the layer's mean over
    its routed slots (experts weighted by their counts), subtracted, never added; each expert's slot outputs are
    recomputed from the experts' weights on the inputs a plain nnsight trace saw.

    Guards against the layer mean being the unweighted mean of the expert means, and against its sign.
    """
    from groundtruth import expert_forward, raw_values

    import moelens
    from moelens.testing import tiny_model

    hf = tiny_model("qwen2_moe")
    reference = copy.deepcopy(hf)
    wrapped = moelens.wrap(hf)
    ids = [5, 17, 42, 9, 88, 3, 64, 23, 7, 51, 30, 12]
    top = 4
    lens = analysis.expert_logit_lens(wrapped, [ids], top=top, relative=True, progress=False)
    assert lens.relative
    names = [moe.path.removeprefix("model.") for moe in wrapped.moes]
    raw = raw_values(reference, {"input_ids": torch.tensor([ids])}, names, wrapped.family)
    for row, (moe, name) in enumerate(zip(wrapped.moes, names)):
        hidden, chosen, weights = raw[name].routing
        hidden, chosen, weights = (value.reshape(len(ids), -1) for value in (hidden, chosen, weights))
        experts = reference.get_submodule(f"{name}.{wrapped.family.experts}")
        width = moe.num_experts
        sums = torch.zeros(width, hidden.shape[-1], dtype=torch.float64)
        counts = [0] * width
        with torch.no_grad():
            for token in range(len(ids)):
                for slot in range(chosen.shape[1]):
                    expert = int(chosen[token, slot])
                    _, out = expert_forward(experts, hidden[token : token + 1], expert)
                    sums[expert] += out[0].double() * float(weights[token, slot])
                    counts[expert] += 1
        assert lens.counts[row, :width].tolist() == counts
        assert len(set(counts)) > 1  # uneven counts: the weighted and unweighted layer means differ
        layer_mean = sums.sum(0) / sum(counts)
        readout = torch.stack([sums[e] / max(counts[e], 1) for e in range(width)]) - layer_mean
        with torch.no_grad():
            logits = reference.lm_head(reference.model.norm(readout.float()))
        for expert in range(width):
            if counts[expert]:
                expected = logits[expert].topk(top)
                assert lens.top_ids[row, expert].tolist() == expected.indices.tolist(), (row, expert)
                torch.testing.assert_close(lens.top_logits[row, expert], expected.values, atol=1e-4, rtol=1e-4)
