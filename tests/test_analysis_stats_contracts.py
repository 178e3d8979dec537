"""Routing statistics (usage, balance, entropy, co-activation, specialisation, top tokens) on hand-made
caches, against numbers worked out by hand.

Ground truth: the experts and weights each token chose, written out in the test, and the statistics
counted from them with plain Python loops, `collections.Counter` and `math` (no moelens code).
"""

from __future__ import annotations

import math
import re
from collections import Counter

import numpy as np
import pytest
import torch

from moelens import analysis
from moelens.errors import MoelensError


def shard_of(rows: dict[int, list[list[int]]], weights: dict[int, list[list[float]]], *, token_ids=None,
             text_index=None, start: int = 0) -> analysis.Shard:
    """A shard of ``len(rows[layer])`` tokens: per layer, each token's experts and weights."""
    count = len(next(iter(rows.values())))
    return analysis.Shard(
        token_ids=torch.tensor(token_ids if token_ids is not None else list(range(start, start + count)), dtype=torch.int32),
        text_index=torch.tensor(text_index if text_index is not None else [0] * count, dtype=torch.int32),
        position=torch.arange(start, start + count, dtype=torch.int32),
        indices={layer: torch.tensor(value, dtype=torch.int16) for layer, value in rows.items()},
        weights={layer: torch.tensor(value, dtype=torch.float32) for layer, value in weights.items()},
    )


def cache_of(shards: list[analysis.Shard], num_experts: dict[int, int], top_k: dict[int, int],
             num_texts: int = 1) -> analysis.RoutingCache:
    layers = sorted(num_experts)
    return analysis.RoutingCache(layers=layers, num_experts=num_experts, top_k=top_k,
                                 score={layer: "softmax" for layer in layers}, num_texts=num_texts, _memory=shards)


def entropy_by_hand(p: list[float]) -> float:
    total = sum(p)
    p = [x / total for x in p]
    return -sum(x * math.log(x) for x in p if x > 0) / math.log(len(p))


# -- top-1: the highest-weighted slot, not the first -----------------------------------------------------

#: Two layers (E = 4, k = 2) whose slots are NOT sorted by weight (as in families that select on biased
#: scores and weigh by the unbiased ones): a token's top-1 expert is the slot of the larger weight.
UNSORTED = {
    0: ([[0, 1], [2, 3], [1, 2], [3, 0]], [[0.3, 0.7], [0.8, 0.2], [0.4, 0.6], [0.1, 0.9]]),
    1: ([[1, 3], [0, 2], [2, 1], [3, 0]], [[0.6, 0.4], [0.35, 0.65], [0.45, 0.55], [0.2, 0.8]]),
}


def unsorted_cache() -> analysis.RoutingCache:
    shard = shard_of({layer: rows for layer, (rows, _) in UNSORTED.items()},
                     {layer: weights for layer, (_, weights) in UNSORTED.items()})
    return cache_of([shard], {0: 4, 1: 4}, {0: 2, 1: 2})


def top1_by_hand(layer: int) -> list[int]:
    rows, weights = UNSORTED[layer]
    return [row[max(range(len(row)), key=lambda slot: w[slot])] for row, w in zip(rows, weights)]


def test_top1_transitions_and_paths_follow_the_highest_weighted_slot_not_the_first():
    """slots="top1" and expert_paths take each token's highest-weighted expert; here it is often the
    second slot, so reading the first slot gives other counts.

    Guards against top-1 being the first slot (true only where a family sorts its slots by weight)."""
    cache = unsorted_cache()
    first, second = top1_by_hand(0), top1_by_hand(1)
    assert first == [1, 2, 2, 0] and second == [1, 2, 1, 0]
    assert first != [row[0] for row in UNSORTED[0][0]]
    expected = [[0] * 4 for _ in range(4)]
    for a, b in zip(first, second):
        expected[a][b] += 1
    result = analysis.transitions(cache, 0, 1)
    assert result.counts.tolist() == expected
    assert result.sources.tolist() == [first.count(e) for e in range(4)]
    paths = Counter(zip(first, second))
    found = analysis.expert_paths(cache, top=10)
    assert dict(found) == dict(paths)
    assert analysis.token_paths(cache).tolist() == [list(path) for path in zip(first, second)]


# -- entropy with a single slot --------------------------------------------------------------------------


def test_weight_entropy_of_one_slot_is_zero_not_nan():
    """With k = 1 one slot takes all the weight: its normalised entropy is 0 (there is nothing to spread
    over), every token in the first bin; never 0 / log 1 = nan."""
    rows = [[0], [2], [1], [2]]
    cache = cache_of([shard_of({0: rows}, {0: [[1.0]] * 4})], {0: 3}, {0: 1})
    result = analysis.routing_entropy(cache, "weights", bins=5)
    assert result.mean.tolist() == [0.0]
    assert result.histogram[0].tolist() == [4, 0, 0, 0, 0]
    assert analysis.token_entropy(cache, 0, "weights").tolist() == [0.0] * 4


# -- specialisation: labels outside 0..C-1 ---------------------------------------------------------------

#: One layer (E = 4, k = 2), five tokens.
ROWS = [[0, 1], [1, 2], [2, 3], [3, 1], [0, 2]]


def spec_cache(text_index: list[int] | None = None, num_texts: int = 1) -> analysis.RoutingCache:
    return cache_of([shard_of({0: ROWS}, {0: [[0.5, 0.5]] * len(ROWS)}, text_index=text_index)],
                    {0: 4}, {0: 2}, num_texts=num_texts)


def pairs_by_hand(labels: list[int], classes: int) -> list[list[int]]:
    pairs = Counter((expert, label) for row, label in zip(ROWS, labels) if 0 <= label < classes for expert in row)
    return [[pairs[(e, c)] for c in range(classes)] for e in range(4)]


def test_specialisation_ignores_negative_labels():
    """A label of -1 is outside 0..C-1 and ignored; it is never counted as the previous expert's last class.

    Token 1 (experts 1 and 2) is labelled -1: were it kept, its keys 1 * C - 1 and 2 * C - 1 would land in
    experts 0 and 1's last class."""
    labels = [0, -1, 1, 1, 0]
    result = analysis.specialisation(spec_cache(), torch.tensor(labels), classes=["a", "b"])
    assert result.counts[0].tolist() == pairs_by_hand(labels, 2)
    assert int(result.counts.sum()) == 2 * 4  # four labelled tokens, k = 2 slots each


def test_specialisation_default_classes_leave_out_the_ignored_label_255():
    """With no class names the classes run to the largest label below 255: 255 marks an unlabelled token."""
    labels = [0, 255, 1, 255, 1]
    result = analysis.specialisation(spec_cache(), torch.tensor(labels))
    assert result.classes == ["0", "1"]
    assert result.counts[0].tolist() == pairs_by_hand(labels, 2)


def test_default_classes_refuse_class_ids_above_the_ignored_255():
    """Labels of 300 classes without class names: the ids from 256 up were dropped without a word (6 of 18 slots
    of a 300-class labelling uncounted); named classes count them."""
    labels = torch.tensor([0, 299, 1, 256, 1])
    with pytest.raises(MoelensError, match=r"labels hold class ids above 255 \(up to 299\): without classes, ids "
                                           r"from 255 up are left out .* \(classes=\[\.\.\.\], 300 names\)"):
        analysis.specialisation(spec_cache(), labels)
    named = analysis.specialisation(spec_cache(), labels, classes=[str(c) for c in range(300)])
    assert named.counts[0].tolist() == pairs_by_hand(labels.tolist(), 300)


def test_per_text_labels_must_have_one_entry_per_text():
    """per="text" labels index texts: one label short of the corpus is refused (here the missing text is
    the last one, whose tokens would otherwise index past the labels or be silently dropped), and so is one too many
    (labels of another corpus: the extra one was dropped and still made a class of its own)."""
    text_index = [0, 0, 1, 1, 2]
    cache = spec_cache(text_index, num_texts=3)
    for given in ([0, 1], [0, 1, 1, 2]):
        with pytest.raises(MoelensError, match=rf"per-text labels must have one entry per corpus item \(3\), got "
                                               rf"{len(given)}\."):
            analysis.specialisation(cache, torch.tensor(given), per="text")
    labels = [1, 0, 1]
    result = analysis.specialisation(cache, torch.tensor(labels), per="text")
    assert result.counts[0].tolist() == pairs_by_hand([labels[t] for t in text_index], 2)


def test_labels_of_the_other_kind_name_the_per_setting_that_fits():
    """One label per text with the default per="token" (or one per token with per="text") was refused with the
    counts alone; the refusal names the `per` that fits such labels."""
    cache = spec_cache([0, 0, 1, 1, 2], num_texts=3)
    with pytest.raises(MoelensError, match=r"one entry per cached token \(5\), got 3\. These are one per corpus item "
                                           r"\(3\): pass per=\"text\"\."):
        analysis.specialisation(cache, torch.tensor([0, 1, 1]))
    with pytest.raises(MoelensError, match=r"one entry per corpus item \(3\), got 5\. These are one per cached token "
                                           r"\(5\): leave per out"):
        analysis.specialisation(cache, torch.tensor([0, 1, 1, 0, 1]), per="text")



def test_class_ids_past_the_named_classes_are_refused_by_place():
    """1-based labels [1, 2, 1] with classes=["harmful", "benign"]: label 2 (one past the last class) was dropped
    without a word, and the texts labelled 1 counted as "benign"; it is refused, naming its place, while a negative
    id and 255 still leave their text out. Ground truth: pairs counted by hand over ROWS."""
    text_index = [0, 0, 1, 1, 2]
    cache = spec_cache(text_index, num_texts=3)
    with pytest.raises(MoelensError, match=r"labels\[1\] is 2, no class id of classes=\['harmful', 'benign'\], which "
                                           r"are 0\.\.1; .*\(1-based labels: subtract 1\), name every class "
                                           r"\(classes=\[\.\.\.\], 3 names\), or pass the labels as class names"):
        analysis.specialisation(cache, [1, 2, 1], classes=["harmful", "benign"], per="text")
    with pytest.raises(MoelensError, match=r"labels\[0\]\[3\] is 2, no class id"):  # in the shape given
        analysis.specialisation(spec_cache(), torch.tensor([[0, 1, 255, 2, -1]]), classes=["a", "b"])
    shifted = [label - 1 for label in [1, 2, 1]]
    result = analysis.specialisation(cache, shifted, classes=["harmful", "benign"], per="text")
    assert result.counts[0].tolist() == pairs_by_hand([shifted[t] for t in text_index], 2)
    for labels in ([0, 255, 1], [0, -1, 1], [255, -3, 255]):
        result = analysis.specialisation(cache, labels, classes=["harmful", "benign"], per="text")
        assert result.counts[0].tolist() == pairs_by_hand([labels[t] for t in text_index], 2), labels


def test_classes_must_be_names_not_the_label_values():
    """classes=sorted(set(labels)) with labels [2, 5, 2]: the ints were taken as names, every label fell outside
    0..1 and nothing was counted, and risk_difference(2, 5) then said there was no class 2 among [2, 5]. Refused by
    place; the values given as names count as such (ground truth: pairs by hand)."""
    text_index = [0, 0, 1, 1, 2]
    cache = spec_cache(text_index, num_texts=3)
    for classes in ([2, 5], ["two", 5], [np.int64(2), "five"]):
        odd = next(c for c, name in enumerate(classes) if not isinstance(name, str))
        with pytest.raises(MoelensError, match=rf"classes\[{odd}\] is {re.escape(repr(classes[odd]))}, no class "
                                               r"name: classes names the classes by text.*labels=\[str\(label\) for "
                                               r"label in labels\]"):
            analysis.specialisation(cache, [2, 5, 2], classes=classes, per="text")
    names = [str(label) for label in [2, 5, 2]]
    result = analysis.specialisation(cache, names, per="text")
    assert result.classes == ["2", "5"]
    assert result.counts[0].tolist() == pairs_by_hand([[0, 1, 0][t] for t in text_index], 2)
    assert torch.equal(result.risk_difference("2", "5"), result.risk_difference(0, 1))


BAD_LABELS = {
    "fraction": ([0, 0.5, 1], r"got list; a class id is a whole number, never rounded: labels\[1\] is 0\.5, a "
                              r"fraction\."),
    "fraction-2d": (torch.tensor([[0.0, 1.0], [2.5, 0.0]]), r"got Tensor of shape \(2, 2\); a class id is a whole "
                                                              r"number, never rounded: labels\[1\]\[0\] is 2\.5"),
    "nan": ([0, float("nan"), 1], r"got list; labels\[1\] is nan, no class id \(a whole number; -1 leaves a token "
                                  r"or text out\)\."),
    "inf": ([0, float("inf"), 1], r"labels\[1\] is inf, no class id"),  # was taken: int64 min, its text dropped
    "-inf": (np.array([0.0, 1.0, -np.inf]), r"got ndarray of shape \(3,\); labels\[2\] is -inf, no class id"),
    "none-among-names": (["a", None, "b"], r"got list; labels\[1\] is None among class names: give every label as "
                                           r"a class name \(str\), or every one as an integer class id"),
    "none-among-ids": ([0, None, 1], r"labels\[1\] is None, no class id \(an integer; -1 leaves a token or text out"),
    "name-among-ids": ([[0, 1], [1, "x"], [0, 0]], r"labels\[1\]\[1\] is 'x', no class id"),
    "ragged": ([[0, 1, 0, 1], [1, 1, 0], [0, 0]],
               r"got list; they are ragged, labels\[0\] holds 4 labels and labels\[1\] holds 3 labels, so they are "
               r"neither one label per text nor one per token: pass one label per cached token, flat in corpus "
               r"order \(\[label for text in labels for label in text\]\), or one label per text with per=\"text\""),
    "ragged-names": ([["a", "b"], ["a"], "b"], r"labels\[0\] holds 2 labels and labels\[1\] holds 1 labels"),
}


@pytest.mark.parametrize("labels, message", BAD_LABELS.values(), ids=BAD_LABELS.keys())
def test_bad_labels_are_refused_naming_the_item_and_its_place(labels, message):
    """Each of these ended "..., got list" whatever was wrong (or, for inf, was taken as an ignored id): the refusal
    names the first bad item by its place, and a ragged list says what to pass instead."""
    with pytest.raises(MoelensError, match=r"labels must be integer class ids .* or class names .*" + message):
        analysis.specialisation(spec_cache([0, 0, 1, 1, 2], num_texts=3), labels, per="text")


def test_labels_as_a_numpy_array_of_names_count_as_the_list():
    """A numpy array of class names (a dataset column) was refused as no ids; it counts as the list it holds, with or
    without classes; so do rows of names shaped like [N, S] windows, as ids of that shape do (refused with no reason,
    review 2). Ground truth: pairs counted by hand over ROWS."""
    names = ["prose", "code", "code", "prose", "code"]
    ids = [["prose", "code"].index(name) for name in names]
    for labels in (np.array(names), np.array(names, dtype=object), np.array([names]), [names], (tuple(names),),
                   [np.array(names)]):
        result = analysis.specialisation(spec_cache(), labels)
        assert result.classes == ["prose", "code"] and result.counts[0].tolist() == pairs_by_hand(ids, 2)
        ordered = analysis.specialisation(spec_cache(), labels, classes=["code", "prose"])
        assert ordered.counts[0].tolist() == pairs_by_hand([1 - i for i in ids], 2)

# -- load balance at the edges ---------------------------------------------------------------------------


def test_balance_of_a_layer_nobody_used_counts_every_expert_unused():
    """A layer whose experts got no slot (every slot skipped): all E experts are unused, the measures NaN (there is
    no load to balance; 0 read as "balanced")."""
    cache = cache_of([shard_of({0: [[-1, -1], [-1, -1]]}, {0: [[0.0, 0.0]] * 2})], {0: 3}, {0: 2})
    usage = analysis.expert_usage(cache)
    assert usage.counts[0].tolist() == [0, 0, 0]
    balance = analysis.load_balance(usage)
    assert balance.unused.tolist() == [3]
    assert balance.cv.isnan().all() and balance.max_over_mean.isnan().all()


def test_a_single_expert_layer_is_perfectly_balanced():
    """With E = 1 (or num_experts=[1]) the usage is trivially uniform: entropy 1, cv 0, max/mean 1."""
    cache = cache_of([shard_of({0: [[0], [1], [0]]}, {0: [[1.0]] * 3})], {0: 2}, {0: 1})
    balance = analysis.load_balance(analysis.expert_usage(cache), num_experts=[1])
    assert balance.entropy.tolist() == [1.0]
    assert balance.cv.tolist() == [0.0] and balance.max_over_mean.tolist() == [1.0]


def test_usage_keeps_each_layers_own_top_k():
    """Usage.top_k is k per layer, in the cache's layer order, and each layer's counts sum to tokens * its k."""
    shard = shard_of({2: [[0], [1], [1]], 5: [[0, 1, 2], [1, 2, 3], [3, 0, 1]]},
                     {2: [[1.0]] * 3, 5: [[0.5, 0.3, 0.2]] * 3})
    usage = analysis.expert_usage(cache_of([shard], {2: 2, 5: 4}, {2: 1, 5: 3}))
    assert usage.layers == [2, 5] and usage.top_k == [1, 3] and usage.num_experts == [2, 4]
    assert usage.counts.tolist() == [[1, 2, 0, 0], [2, 3, 2, 2]]
    assert usage.counts.sum(-1).tolist() == [3 * 1, 3 * 3]


# -- top tokens over several shards ----------------------------------------------------------------------


def test_top_tokens_share_counts_a_tokens_occurrences_in_every_shard():
    """share = slots of the token routed to the expert / the token's occurrences over the whole cache: the
    occurrences of the first shard still count when a later shard holds a larger token id."""
    token_ids = [[3, 5, 3], [3, 9, 5, 3]]
    rows = [[[0], [1], [0]], [[1], [0], [0], [0]]]
    shards, start = [], 0
    for ids, chosen in zip(token_ids, rows):
        shards.append(shard_of({0: chosen}, {0: [[1.0]] * len(chosen)}, token_ids=ids, start=start))
        start += len(ids)
    cache = cache_of(shards, {0: 2}, {0: 1})
    seen = Counter(token for ids in token_ids for token in ids)
    served = Counter((row[0], token) for ids, chosen in zip(token_ids, rows) for token, row in zip(ids, chosen))
    for expert in range(2):
        (result,) = analysis.top_tokens(cache, 0, [expert], n=10, by="count")
        assert sorted(result.token_ids.tolist()) == sorted(t for (e, t) in served if e == expert)
        for token, count, share in zip(result.token_ids.tolist(), result.counts.tolist(), result.share.tolist()):
            assert count == served[(expert, token)]
            assert math.isclose(share, served[(expert, token)] / seen[token], rel_tol=1e-12), (expert, token)
    (zero,) = analysis.top_tokens(cache, 0, [0], by="share", min_count=4)
    assert zero.token_ids.tolist() == [3] and math.isclose(float(zero.share[0]), 3 / 4)


def test_top_tokens_counts_a_token_once_where_its_slots_name_the_expert_twice():
    """After a swap to an expert a token already uses (collect_generation(intervene=...)), two of its slots name one
    expert: counts and share count the token's occurrences (share at most 1), total counts every slot, and
    Usage.token_fraction counts slots."""
    token_ids = [4, 4, 6, 6]
    rows = [[1, 1], [1, 0], [1, 1], [0, 2]]
    shard = shard_of({0: rows}, {0: [[0.5, 0.5]] * 4}, token_ids=token_ids)
    cache = cache_of([shard], {0: 3}, {0: 2})
    (result,) = analysis.top_tokens(cache, 0, [1], n=10, by="share", min_count=1)
    reached = Counter(token for token, row in zip(token_ids, rows) if 1 in row)
    assert result.token_ids.tolist() == [4, 6]
    assert result.counts.tolist() == [reached[4], reached[6]] == [2, 1]
    assert result.share.tolist() == [1.0, 0.5]
    assert result.total == sum(row.count(1) for row in rows) == 5
    assert analysis.expert_usage(cache).token_fraction[0, 1].item() == 5 / 4


def tie_cache() -> tuple[analysis.RoutingCache, list[int], list[int]]:
    """One layer (E = 2, k = 1): tokens 4, 5, 9 each routed to expert 0 twice, seen 8, 2 and 4 times; tokens 7
    and 8 routed to expert 0 once each and seen twice each."""
    token_ids, experts = [], []
    for token, served, seen in ((4, 2, 8), (5, 2, 2), (9, 2, 4), (7, 1, 2), (8, 1, 2)):
        token_ids += [token] * seen
        experts += [0] * served + [1] * (seen - served)
    shard = shard_of({0: [[e] for e in experts]}, {0: [[1.0]] * len(experts)}, token_ids=token_ids)
    return cache_of([shard], {0: 2}, {0: 1}), token_ids, experts


def test_top_tokens_by_count_breaks_ties_by_share():
    """by="count": most routed first; among tokens routed equally often, the larger share first."""
    cache, token_ids, experts = tie_cache()
    seen = Counter(token_ids)
    served = Counter(t for t, e in zip(token_ids, experts) if e == 0)
    expected = sorted(served, key=lambda t: (-served[t], -served[t] / seen[t]))
    assert expected == [5, 9, 4, 7, 8]
    (result,) = analysis.top_tokens(cache, 0, [0], n=10, by="count")
    assert result.token_ids.tolist() == expected
    assert result.counts.tolist() == [served[t] for t in expected]


def test_top_tokens_by_share_breaks_ties_by_count():
    """by="share": the largest share first; among tokens of equal share, the one routed more often first
    (token 9, 2 of 4, before tokens 7 and 8, 1 of 2 each: all three have a share of 1/2)."""
    cache, token_ids, experts = tie_cache()
    seen = Counter(token_ids)
    served = Counter(t for t, e in zip(token_ids, experts) if e == 0)
    expected = sorted(served, key=lambda t: (-served[t] / seen[t], -served[t]))
    assert expected == [5, 9, 7, 8, 4]
    (result,) = analysis.top_tokens(cache, 0, [0], n=10, by="share", min_count=0)
    assert result.token_ids.tolist() == expected


def test_top_tokens_by_share_lets_the_count_break_exact_ties_only():
    """A token served 100000 times at a share of 1/2 ranks below one served 50001 times at 50001/100000: the
    count breaks ties of share, never outweighs a real difference (a weighted sum of the two keys did)."""
    seen, served = {7: 200_000, 8: 100_000}, {7: 100_000, 8: 50_001}
    token_ids = torch.cat([torch.full((seen[t],), t, dtype=torch.int32) for t in seen])
    experts = torch.cat([torch.cat([torch.zeros(served[t]), torch.ones(seen[t] - served[t])]) for t in seen])
    count = len(token_ids)
    shard = analysis.Shard(token_ids=token_ids, text_index=torch.zeros(count, dtype=torch.int32),
                           position=torch.arange(count, dtype=torch.int32),
                           indices={0: experts.to(torch.int16)[:, None]}, weights={0: torch.ones(count, 1)})
    expected = sorted(seen, key=lambda t: -served[t] / seen[t])
    assert expected == [8, 7]
    (result,) = analysis.top_tokens(cache_of([shard], {0: 2}, {0: 1}), 0, [0], n=2, by="share")
    assert result.token_ids.tolist() == expected
    assert result.counts.tolist() == [served[t] for t in expected]


def test_expert_paths_of_equal_count_come_in_path_order_however_the_cache_is_sharded():
    """Four paths seen once each, split over two shards or in one: the top two are the two smallest paths
    (ties were broken by the order shards first saw them, so the cut at ``top`` depended on the sharding)."""
    rows = {0: [[3], [2], [1], [0]], 1: [[3], [2], [1], [0]]}
    weights = {0: [[1.0]] * 4, 1: [[1.0]] * 4}
    halves = [shard_of({layer: value[:2] for layer, value in rows.items()},
                       {layer: value[:2] for layer, value in weights.items()}),
              shard_of({layer: value[2:] for layer, value in rows.items()},
                       {layer: value[2:] for layer, value in weights.items()}, start=2)]
    paths = [tuple(rows[layer][token][0] for layer in (0, 1)) for token in range(4)]
    expected = [(path, 1) for path in sorted(paths)[:2]]
    assert expected == [((0, 0), 1), ((1, 1), 1)]
    for shards in (halves, [shard_of(rows, weights)]):
        assert analysis.expert_paths(cache_of(shards, {0: 4, 1: 4}, {0: 1, 1: 1}), top=2) == expected


# -- agreement of two routings of the same tokens ----------------------------------------------------------------


def agreement_pair() -> tuple[analysis.RoutingCache, analysis.RoutingCache, dict, dict]:
    """Two caches of the same 5 tokens, cut into shards at other tokens: layer 0 (E = 4) at k = 2 in the first and
    k = 3 in the second (one slot skipped), layer 3 (E = 3) at k = 1 in both; slots not sorted by weight."""
    first = {0: [[0, 1], [2, 3], [1, 0], [3, 2], [0, 2]], 3: [[0], [1], [2], [2], [0]]}
    first_weights = {0: [[0.3, 0.7], [0.6, 0.4], [0.5, 0.5], [0.2, 0.8], [0.9, 0.1]], 3: [[1.0]] * 5}
    second = {0: [[1, 0, 2], [2, 3, -1], [0, 1, 3], [2, 1, 0], [3, 1, 2]], 3: [[0], [2], [2], [1], [0]]}
    second_weights = {0: [[0.5, 0.3, 0.2], [0.7, 0.3, 0.0], [0.4, 0.3, 0.3], [0.5, 0.3, 0.2], [0.5, 0.3, 0.2]],
                      3: [[1.0]] * 5}

    def cut(rows, weights, bounds):
        return [shard_of({layer: value[a:b] for layer, value in rows.items()},
                         {layer: value[a:b] for layer, value in weights.items()}, start=a) for a, b in bounds]

    a = cache_of(cut(first, first_weights, [(0, 2), (2, 5)]), {0: 4, 3: 3}, {0: 2, 3: 1})
    b = cache_of(cut(second, second_weights, [(0, 3), (3, 4), (4, 5)]), {0: 4, 3: 3}, {0: 3, 3: 1})
    return a, b, (first, first_weights), (second, second_weights)


def test_routing_agreement_by_hand_over_shards_cut_at_other_tokens():
    """top1 (highest weight, not the first slot), Jaccard of each token's expert sets (skipped slots name none),
    same set and per-expert kept, against Python sets."""
    a, b, (rows_a, weights_a), (rows_b, weights_b) = agreement_pair()
    agreement = analysis.routing_agreement(a, b)
    assert agreement.layers == [0, 3] and agreement.tokens == 5
    for row, layer in enumerate([0, 3]):
        best = lambda rows, weights, t: rows[layer][t][max(range(len(weights[layer][t])),  # noqa: E731
                                                            key=weights[layer][t].__getitem__)]
        sets_a = [set(e for e in slots if e >= 0) for slots in rows_a[layer]]
        sets_b = [set(e for e in slots if e >= 0) for slots in rows_b[layer]]
        top1 = sum(best(rows_a, weights_a, t) == best(rows_b, weights_b, t) for t in range(5)) / 5
        jaccard = sum(len(x & y) / len(x | y) for x, y in zip(sets_a, sets_b)) / 5
        assert math.isclose(agreement.top1[row], top1) and math.isclose(agreement.jaccard[row], jaccard)
        assert math.isclose(agreement.same_set[row], sum(x == y for x, y in zip(sets_a, sets_b)) / 5)
        for expert in range(4):
            mine = [t for t in range(5) if expert in sets_a[t]]
            kept = float(agreement.kept[row, expert])
            if not mine:  # expert 3 of layer 3, past its E = 3
                assert math.isnan(kept), (layer, expert)
            else:
                assert math.isclose(kept, sum(expert in sets_b[t] for t in mine) / len(mine)), (layer, expert)
    assert agreement.as_rows()[1] == {"layer": 3, "top1": 0.6, "jaccard": 0.6, "same_set": 0.6}
    assert "top1" in repr(agreement) and " 60.0%" in repr(agreement)


def test_routing_agreement_refuses_caches_it_cannot_compare_token_by_token():
    a, b, *_ = agreement_pair()
    shorter = cache_of([next(b.shards())], {0: 4, 3: 3}, {0: 3, 3: 1})
    with pytest.raises(MoelensError, match="holds 5 tokens and the second 3"):
        analysis.routing_agreement(a, shorter)
    other = [shard.copy() for shard in b.shards()]
    other[1].token_ids[0] = 99
    with pytest.raises(MoelensError, match=r"token 3 is id 3 .* id 99 at position 3"):
        analysis.routing_agreement(a, cache_of(other, {0: 4, 3: 3}, {0: 3, 3: 1}))
    wider = cache_of([shard.copy() for shard in b.shards()], {0: 5, 3: 3}, {0: 3, 3: 1})
    with pytest.raises(MoelensError, match="layer 0 has 4 experts in the first cache and 5 in the second"):
        analysis.routing_agreement(a, wider)
    alone = cache_of([shard_of({7: [[0]] * 5}, {7: [[1.0]] * 5})], {7: 2}, {7: 1})
    with pytest.raises(MoelensError, match="no MoE layer in common"):
        analysis.routing_agreement(a, alone)
    with pytest.raises(MoelensError, match=r"second must be a RoutingCache, got Usage.*\.cache"):
        analysis.routing_agreement(a, analysis.expert_usage(b))
