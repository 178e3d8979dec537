"""Contracts of the routing analysis that a plausible slip would break silently: a routing cache's shards checked
against their routing.json, shard boundaries, skip-class slots, tokenizer outputs, the stats rows and the commands.

Truths are independent of the code under test: files edited by hand on disk, plain nnsight reads of the tiny
models, numbers recomputed here from the cached indices and weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import moelens
from groundtruth import ascii_tokenizer
from moelens import analysis
from moelens.analysis.cache import META_FILE, RoutingCache
from moelens.analysis.report import layer_stats
from moelens.errors import MoelensError
from moelens.testing import tiny_model

TEXTS = ["def add(a, b):\n    return a + b\n", "The sum.", "x = [i for i in range(9)]"]


@pytest.fixture(scope="module")
def model():
    """A tiny Mixtral (MoE layers of 8 experts, top-2) with a character tokenizer."""
    return moelens.wrap(tiny_model("mixtral"), tokenizer=ascii_tokenizer())


def char_id(char: str) -> int:
    """The ascii tokenizer's id of one character: its code point when printable, else <unk> (3)."""
    return ord(char) if 32 <= ord(char) < 127 else 3


def shard_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as file:
        return {name: file.get_tensor(name) for name in file.keys()}, file.metadata() or {}


# -- a cache on disk is read only as what its routing.json says ---------------------------------------------------


def test_a_shard_that_lacks_a_layer_routing_json_lists_is_damaged(model, tmp_path):
    """A shard file rewritten by hand without one layer (same collection id, same token count): reading that layer
    must say which file is damaged, not fail with a bare KeyError."""
    folder = tmp_path / "cache"
    cache = analysis.collect_routing(model, TEXTS, batch_size=1, folder=str(folder), progress=False)
    dropped = cache.layers[-1]
    path = folder / "shard-00000.safetensors"
    tensors, metadata = shard_tensors(path)
    for kind in ("indices", "weights"):
        del tensors[f"{kind}.{dropped}"]
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(MoelensError, match=rf"routing cache file '{path}' is damaged .*layers"):
        RoutingCache.load(folder).indices(dropped)


def test_a_shard_of_another_collection_is_not_read_as_this_caches(model, tmp_path):
    """Two corpora of the same token count and layers in two folders: a shard file copied from one folder into the
    other is another collection's (its metadata says so), and is refused naming that shard rather than read as this
    corpus (it was called a cache replaced after it was opened, which opening it again did not mend)."""
    first, second = tmp_path / "first", tmp_path / "second"
    ids = torch.arange(4, 68).reshape(4, 16)
    analysis.collect_routing(model, ids, folder=str(first), progress=False)
    analysis.collect_routing(model, ids.flip(-1), folder=str(second), progress=False)
    shutil.copyfile(second / "shard-00000.safetensors", first / "shard-00000.safetensors")
    with pytest.raises(MoelensError, match=rf"routing cache file '{first / 'shard-00000.safetensors'}' is damaged \(a "
                                           "collection other than the one routing.json lists wrote it"):
        RoutingCache.load(first).token_ids()


def test_a_cache_whose_folder_a_stopped_collection_emptied_says_it_was_replaced(model, tmp_path):
    """A later collection into the folder stopped after routing its first batch (it deleted the old shards and
    wrote none yet): the older cache object must say its folder was replaced, not that its files are damaged."""
    folder = tmp_path / "cache"
    old = analysis.collect_routing(model, TEXTS, folder=str(folder), progress=False)

    def stopped():
        yield from TEXTS
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        analysis.collect_routing(model, stopped(), batch_size=1, folder=str(folder), progress=False)
    with pytest.raises(MoelensError, match="was replaced after this cache object opened it"):
        old.token_ids()


def hand_cache(layers: list[int], rows: int = 3) -> RoutingCache:
    """A cache of ``rows`` tokens whose layer ``l`` routes token ``t`` to experts (t + l) % 4 and (t + l + 1) % 4
    with weights 0.75 / 0.25, and logits ``l * 10 + [t, 0, -t, 2t]``."""
    indices = {layer: torch.tensor([[(t + layer) % 4, (t + layer + 1) % 4] for t in range(rows)], dtype=torch.int16)
               for layer in layers}
    weights = {layer: torch.tensor([[0.75, 0.25]] * rows) for layer in layers}
    logits = {layer: torch.tensor([[layer * 10.0 + t, 0.0, -t, 2.0 * t] for t in range(rows)]) for layer in layers}
    shard = analysis.Shard(token_ids=torch.arange(rows, dtype=torch.int32), text_index=torch.zeros(rows, dtype=torch.int32),
                           position=torch.arange(rows, dtype=torch.int32), indices=indices, weights=weights, logits=logits)
    return RoutingCache(layers=list(layers), num_experts={layer: 4 for layer in layers}, top_k={layer: 2 for layer in layers},
                        score={layer: "softmax" for layer in layers}, num_texts=1,
                        has_logits=True, _memory=[shard])


def test_a_saved_cache_of_layers_past_nine_reads_back(tmp_path):
    """Layers 9 and 10: their shard keys sort as text ("indices.10" before "indices.9"), not as layers; the cache
    must still read back each layer's own routing."""
    cache = hand_cache([9, 10])
    loaded = RoutingCache.load(cache.save(tmp_path / "cache"))
    assert loaded.layers == [9, 10]
    for layer in (9, 10):
        assert loaded.indices(layer).tolist() == [[(t + layer) % 4, (t + layer + 1) % 4] for t in range(3)]
        assert loaded.logits(layer)[:, 0].tolist() == [layer * 10.0 + t for t in range(3)]


def test_a_routing_json_listing_a_shard_outside_its_folder_is_damaged(model, tmp_path):
    """A routing.json whose shard entry points out of its folder (../other/shard-00000.safetensors, a file that
    exists) is refused at load, not read: moelens reads and writes only its own shard names in the folder."""
    first, other = tmp_path / "first", tmp_path / "other"
    analysis.collect_routing(model, TEXTS, folder=str(first), progress=False)
    analysis.collect_routing(model, TEXTS, folder=str(other), progress=False)
    meta = json.loads((first / META_FILE).read_text())
    meta["shards"][0]["file"] = "../other/shard-00000.safetensors"
    (first / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(MoelensError, match=r"is damaged .*lists the shard file '../other/shard-00000.safetensors'"):
        RoutingCache.load(first)


def test_saving_a_cache_into_the_folder_it_reads_from_keeps_it(model, tmp_path):
    """cache.save(its own folder) is a no-op: the shards are not deleted and rewritten under the object reading them
    (which would lose every shard after the first and leave the object reading another collection)."""
    folder = tmp_path / "cache"
    cache = analysis.collect_routing(model, TEXTS, batch_size=1, shard_tokens=1, folder=str(folder), progress=False)
    assert cache.num_shards == len(TEXTS)
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    for target in (folder, tmp_path / "." / "cache"):
        assert cache.save(target) == target
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == before
    expected = torch.tensor([char_id(char) for text in TEXTS for char in text])
    assert torch.equal(cache.token_ids(), expected) and torch.equal(RoutingCache.load(folder).token_ids(), expected)


def test_an_empty_corpus_collected_into_a_folder_replaces_the_cache_there(model, tmp_path):
    """A corpus with no tokens still writes its (empty) cache: into a new folder (created), and into a folder with an
    older cache, whose shards it removes, so the folder holds only the new cache and takes a later collection."""
    fresh = tmp_path / "fresh"
    empty = analysis.collect_routing(model, ["", ""], folder=str(fresh), progress=False)
    assert empty.num_tokens == 0 and empty.num_texts == 2 and sorted(p.name for p in fresh.iterdir()) == [META_FILE]
    folder = tmp_path / "cache"
    analysis.collect_routing(model, TEXTS, batch_size=1, shard_tokens=1, folder=str(folder), progress=False)
    analysis.collect_routing(model, [""], folder=str(folder), progress=False)
    assert sorted(p.name for p in folder.iterdir()) == [META_FILE]
    assert RoutingCache.load(folder).num_tokens == 0
    again = analysis.collect_routing(model, TEXTS[:1], folder=str(folder), progress=False)
    assert again.num_tokens == len(TEXTS[0])


# -- collection: shards, stored values ------------------------------------------------------------------------------


def test_a_shard_closes_after_the_batch_that_reaches_its_size(model, tmp_path):
    """shard_tokens=8 over three 8-token texts, one per batch: each batch reaches the size, so three shards of 8 (a
    shard closed only past the size would hold 16 tokens, twice the bound a shard is held in memory at)."""
    texts = ["abcdefgh", "ijklmnop", "qrstuvwx"]
    folder = tmp_path / "cache"
    cache = analysis.collect_routing(model, texts, batch_size=1, shard_tokens=8, folder=str(folder), progress=False)
    assert [entry["tokens"] for entry in json.loads((folder / META_FILE).read_text())["shards"]] == [8, 8, 8]
    memory = analysis.collect_routing(model, texts, batch_size=1, shard_tokens=8, progress=False)
    assert [shard.num_tokens for shard in memory.shards()] == [8, 8, 8]
    assert cache.token_ids().tolist() == [ord(char) for text in texts for char in text]


def test_a_cache_without_logits_stores_none(model, tmp_path):
    """logits=False: no shard holds router logits, in memory or on disk (they are [T, E] per layer, the bulk of a
    cache)."""
    memory = analysis.collect_routing(model, TEXTS, progress=False)
    assert all(shard.logits == {} for shard in memory.shards())
    folder = tmp_path / "cache"
    analysis.collect_routing(model, TEXTS, folder=str(folder), progress=False)
    names, _ = shard_tensors(folder / "shard-00000.safetensors")
    assert not [name for name in names if name.startswith("logits")]
    assert sorted({name.split(".")[0] for name in names}) == ["indices", "position", "text_index", "token_ids", "weights"]


# -- corpus: padding, vocabulary, windows, special tokens -----------------------------------------------------------


def test_a_pad_token_just_past_the_vocabulary_is_not_used_to_pad():
    """A pad id equal to the vocabulary size (the first id past it) is no embedded id either."""
    from moelens.analysis import corpus as corpora

    tokenizer = ascii_tokenizer()
    hf = tiny_model("mixtral")
    extra = hf.config.vocab_size - len(tokenizer)  # the added pad token gets the first id past them
    tokenizer.add_special_tokens({"additional_special_tokens": [f"<x{i}>" for i in range(extra)]})
    tokenizer.add_special_tokens({"pad_token": "<newpad>"})
    assert tokenizer.pad_token_id == hf.config.vocab_size
    wrapped = moelens.wrap(hf, tokenizer=tokenizer)
    assert corpora.pad_id(wrapped) == tokenizer.eos_token_id
    cache = analysis.collect_routing(wrapped, TEXTS, batch_size=3, progress=False)
    assert cache.num_tokens == sum(map(len, TEXTS))


def test_the_default_window_is_the_context_capped_at_512():
    from types import SimpleNamespace

    from moelens.analysis import corpus as corpora

    for context, window in ((128, 128), (512, 512), (4096, 512), (None, 512)):
        model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=context))
        assert corpora.default_max_length(model) == window


def test_text_is_routed_without_the_tokenizers_special_tokens(model):
    """A tokenizer that adds <s> to every text (a post-processor): the cache holds the text's own tokens only."""
    from tokenizers import processors

    tokenizer = ascii_tokenizer()
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    assert tokenizer("ab")["input_ids"] == [1, 97, 98]
    wrapped = moelens.wrap(tiny_model("mixtral"), tokenizer=tokenizer)
    cache = analysis.collect_routing(wrapped, ["ab", "cde"], progress=False)
    assert cache.token_ids().tolist() == [97, 98, 99, 100, 101]
    assert cache.position().tolist() == [0, 1, 0, 1, 2]


# -- the stats rows ---------------------------------------------------------------------------------------------------


def test_stats_rows_and_expert_rows_by_hand():
    """Five tokens of one layer (E = 4, k = 2) written out here; each number of the rows worked out with math:
    slot counts 4/3/2/1, shares = count / 10 slots, mean weight = summed weight / count, the busiest three experts, the
    weight entropy (over the k weights, / log k) and the router entropy (softmax over E, / log E), told apart."""
    import math

    chosen = [[0, 1], [0, 2], [0, 1], [3, 0], [1, 2]]
    weights = [[0.75, 0.25], [0.75, 0.25], [0.75, 0.25], [0.5, 0.5], [0.75, 0.25]]
    logits = [[2.0, 0.0, 0.0, 0.0]] * 5
    shard = analysis.Shard(token_ids=torch.arange(5, dtype=torch.int32), text_index=torch.zeros(5, dtype=torch.int32),
                           position=torch.arange(5, dtype=torch.int32), indices={0: torch.tensor(chosen, dtype=torch.int16)},
                           weights={0: torch.tensor(weights, dtype=torch.float16)}, logits={0: torch.tensor(logits)})
    cache = RoutingCache(layers=[0], num_experts={0: 4}, top_k={0: 2}, score={0: "softmax"}, num_texts=1, has_logits=True,
                         _memory=[shard])

    def entropy(p: list[float]) -> float:
        total = sum(p)
        return -sum(x / total * math.log(x / total) for x in p if x > 0) / math.log(len(p))

    counts = {expert: sum(row.count(expert) for row in chosen) for expert in range(4)}
    summed = {expert: sum(w for row, ws in zip(chosen, weights) for e, w in zip(row, ws) if e == expert)
              for expert in range(4)}
    assert counts == {0: 4, 1: 3, 2: 2, 3: 1}
    stats = layer_stats(cache)
    experts = stats.expert_rows()
    assert [row["count"] for row in experts] == [4, 3, 2, 1]
    assert [row["share"] for row in experts] == pytest.approx([counts[e] / 10 for e in range(4)])
    assert [row["mean_weight"] for row in experts] == pytest.approx([summed[e] / counts[e] for e in range(4)])
    (row,) = stats.rows()
    assert row["tokens"] == 5 and row["experts"] == 4 and row["top_k"] == 2
    assert row["busiest_experts"] == [0, 1, 2] and row["busiest_shares"] == pytest.approx([0.4, 0.3, 0.2])
    weight_entropy = sum(entropy(ws) for ws in weights) / 5
    router_entropy = entropy([math.exp(x) for x in logits[0]])
    assert abs(weight_entropy - router_entropy) > 0.05
    assert row["weight_entropy"] == pytest.approx(weight_entropy, rel=1e-5)
    assert row["router_entropy"] == pytest.approx(router_entropy, rel=1e-5)


def test_the_busiest_experts_leave_out_experts_no_token_chose():
    """One token routed to experts 2 and 1 of four: the busiest were listed as three, the third an expert with a
    share of 0."""
    shard = analysis.Shard(token_ids=torch.arange(1, dtype=torch.int32), text_index=torch.zeros(1, dtype=torch.int32),
                           position=torch.arange(1, dtype=torch.int32), indices={0: torch.tensor([[2, 1]], dtype=torch.int16)},
                           weights={0: torch.tensor([[0.75, 0.25]], dtype=torch.float16)}, logits={})
    cache = RoutingCache(layers=[0], num_experts={0: 4}, top_k={0: 2}, score={0: "softmax"}, num_texts=1, has_logits=False,
                         _memory=[shard])
    (row,) = layer_stats(cache).rows()
    assert sorted(row["busiest_experts"]) == [1, 2] and row["busiest_shares"] == [0.5, 0.5]
    # without logits no router entropy: the row had a "weights_entropy" column equal to weight_entropy instead
    weights = torch.tensor([0.75, 0.25])
    assert row["router_entropy"] is None and "weights_entropy" not in row
    assert row["weight_entropy"] == pytest.approx(float(-(weights * weights.log()).sum() / torch.log(torch.tensor(2.0))), rel=1e-3)


def test_a_tokenizers_output_for_one_text_as_lists_is_one_item(model):
    """tokenizer("text") without return_tensors holds one row as a flat list of ids (and its mask as a flat list):
    that is one corpus item, not one item per token."""
    tokenizer = ascii_tokenizer()
    encoding = tokenizer("sum(ab)")
    assert encoding["input_ids"] == [ord(char) for char in "sum(ab)"]
    cache = analysis.collect_routing(model, encoding, progress=False)
    assert cache.num_texts == 1 and cache.token_ids().tolist() == encoding["input_ids"]
    assert cache.position().tolist() == list(range(7)) and cache.text_index().tolist() == [0] * 7


# -- describe ----------------------------------------------------------------------------------------------------------


def test_describe_groups_each_layer_once_when_a_layer_holds_several_blocks():
    """Blocks are listed per block, so a layer of two blocks (ernie4_5_vl_moe's text / vision) comes twice: the
    grouped text names it once."""
    from moelens.analysis.describe import by_layers

    assert by_layers([(1, "softmax"), (1, "softmax"), (2, "softmax")]) == "softmax"
    pairs = [(0, "hash"), (0, "hash"), (1, "softmax"), (1, "softmax"), (2, "softmax")]
    assert by_layers(pairs) == "layer 0: hash; layers 1, 2: softmax"


# -- the per-token view ---------------------------------------------------------------------------------------------


def test_token_view_top1_is_each_tokens_highest_weighted_expert(model):
    """top1() per layer and token: the expert of the largest weight among the cached slots (read here from a plain
    collection, slots in the family's order)."""
    text = TEXTS[0]
    view = analysis.token_routing(model, text)
    cache = analysis.collect_routing(model, [text], dtype=torch.float32, progress=False)
    for row, layer in enumerate(cache.layers):
        indices, weights = cache.indices(layer).tolist(), cache.weights(layer).tolist()
        best = [slots[max(range(len(slots)), key=lambda s: ws[s])] for slots, ws in zip(indices, weights)]
        assert view.top1()[row].tolist() == best
        assert (view.weights[row, :, 0] >= view.weights[row, :, -1]).all()


def test_token_view_takes_a_batch_of_one_as_that_text(model):
    ids = torch.tensor([ord(char) for char in TEXTS[1]])
    alone = analysis.token_routing(model, ids)
    for batch in (ids[None], [TEXTS[1]], ids[None].numpy()):
        view = analysis.token_routing(model, batch)
        assert torch.equal(view.token_ids, alone.token_ids) and torch.equal(view.indices, alone.indices)


# -- the commands ------------------------------------------------------------------------------------------------------


def test_a_checkpoint_folder_named_tiny_is_the_users_not_moelens_tiny(tmp_path, monkeypatch, capsys):
    """`moelens inspect tiny` in a folder holding a checkpoint folder named tiny inspects that checkpoint (an OLMoE
    here, saved by this test), not the embedded moelens-tiny."""
    from moelens.cli import main

    tiny_model("olmoe").save_pretrained(tmp_path / "tiny")
    monkeypatch.chdir(tmp_path)
    assert main(["inspect", "tiny", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["family"] == "olmoe" and report["model_type"] == "olmoe"
