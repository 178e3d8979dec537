"""The routing cache: saved and loaded exactly, streamed to disk in shards, corpora cut into windows."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Callable

import pytest
import torch

import moelens
from moelens import analysis
from moelens.analysis import corpus as corpora
from moelens.analysis.cache import META_FILE, RoutingCache
from moelens.errors import MoelensError
from moelens.testing import tiny_model


@pytest.fixture(scope="module")
def model():
    return moelens.wrap(tiny_model("mixtral"))


def token_corpus(count: int = 9, seed: int = 3) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 120, (int(n),), generator=generator).tolist()
            for n in torch.randint(1, 30, (count,), generator=generator)]


def assert_same(a: RoutingCache, b: RoutingCache) -> None:
    assert a.meta() | {"shards": None} == b.meta() | {"shards": None}
    for name in ("token_ids", "text_index", "position"):
        assert torch.equal(getattr(a, name)(), getattr(b, name)())
    for layer in a.layers:
        assert torch.equal(a.indices(layer), b.indices(layer))
        assert torch.equal(a.weights(layer), b.weights(layer))
        if a.has_logits:
            assert torch.equal(a.logits(layer), b.logits(layer))


def test_round_trip(model, tmp_path):
    cache = analysis.collect_routing(model, token_corpus(), batch_size=4, max_length=16, logits=True,
                                     shard_tokens=40, progress=False)
    assert cache.num_shards > 1 and not cache.on_disk
    folder = cache.save(tmp_path / "cache")
    meta = json.loads((folder / META_FILE).read_text())
    assert meta["num_tokens"] == cache.num_tokens and len(meta["shards"]) == cache.num_shards
    loaded = RoutingCache.load(folder)
    assert loaded.on_disk and loaded.num_shards == cache.num_shards
    assert_same(cache, loaded)
    assert loaded.indices(loaded.layers[0]).dtype == torch.int64
    stored = next(loaded.shards())
    assert stored.indices[loaded.layers[0]].dtype == torch.int16
    assert stored.weights[loaded.layers[0]].dtype == torch.float16
    assert_same(cache, loaded.materialize())
    again = loaded.save(tmp_path / "copy")
    assert_same(cache, RoutingCache.load(again))


def test_streaming_to_disk_equals_memory_and_stats_agree(model, tmp_path):
    corpus = token_corpus(12)
    memory = analysis.collect_routing(model, corpus, batch_size=3, max_length=8, shard_tokens=25, progress=False)
    disk = analysis.collect_routing(model, iter(corpus), batch_size=3, max_length=8, shard_tokens=25,
                                    folder=str(tmp_path / "stream"), progress=False)
    assert disk.on_disk
    files = sorted(path.name for path in (tmp_path / "stream").glob("shard-*.safetensors"))
    assert len(files) == disk.num_shards > 2
    assert max(tokens for _, tokens in disk._files) < 25 + 3 * 8  # a shard never exceeds one batch past its size
    assert_same(memory, disk)
    assert torch.equal(analysis.expert_usage(memory).counts, analysis.expert_usage(disk).counts)
    layer = memory.layers[1]
    assert torch.equal(analysis.coactivation(memory, layer).counts, analysis.coactivation(disk, layer).counts)


@pytest.mark.parametrize("umask", [0o022, 0o077], ids=["022", "077"])
def test_shards_get_the_mode_the_users_umask_gives_a_new_file(model, tmp_path, umask):
    """safetensors writes a shard through a private temporary file: shards were 0600 beside a 0644 routing.json, so
    a cache shared with colleagues listed shards they could not read. Truth: the umask, as os.open applies it."""
    previous = os.umask(umask)
    try:
        analysis.collect_routing(model, token_corpus(), max_length=16, shard_tokens=40, progress=False,
                                 folder=tmp_path / "streamed")
        saved = analysis.collect_routing(model, token_corpus(), max_length=16, shard_tokens=40,
                                         progress=False).save(tmp_path / "saved")
    finally:
        os.umask(previous)
    for cache in (tmp_path / "streamed", saved):
        shards = sorted(cache.glob("shard-*.safetensors"))
        assert len(shards) > 1
        for path in (*shards, cache / META_FILE):
            assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path


def test_corpus_is_read_lazily(model):
    seen = []

    def texts():
        for index, ids in enumerate(token_corpus(6)):
            seen.append(index)
            yield ids

    batches = corpora.batches(texts(), None, batch_size=2, max_length=64, pad=0)
    first = next(batches)
    assert first.input_ids.shape[0] == 2 and seen == [0, 1]


def test_windows_padding_and_positions():
    ids = torch.arange(10, 30).reshape(2, 10)
    batches = list(corpora.batches(ids, None, batch_size=3, max_length=4, pad=0))
    assert [b.input_ids.shape for b in batches] == [torch.Size([3, 4]), torch.Size([3, 4])]
    first, last = batches
    assert first.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]]
    assert first.input_ids[2].tolist() == [18, 19, 0, 0]  # right padding
    assert first.text_index.tolist() == [0, 0, 0] and first.offset.tolist() == [0, 4, 8]
    assert last.text_index.tolist() == [1, 1, 1] and last.input_ids[0].tolist() == [20, 21, 22, 23]


def test_load_and_corpus_errors(model, tmp_path):
    with pytest.raises(MoelensError, match="routing.json"):
        RoutingCache.load(tmp_path)
    (tmp_path / META_FILE).write_text(json.dumps({"format": 99}))
    with pytest.raises(MoelensError, match="format 99"):
        RoutingCache.load(tmp_path)
    with pytest.raises(MoelensError, match="token ids"):
        analysis.collect_routing(model, [torch.zeros(2, 2)], progress=False)
    with pytest.raises(MoelensError, match="batch_size"):
        analysis.collect_routing(model, [[1, 2]], batch_size=0, progress=False)
    empty = analysis.collect_routing(model, [[], []], progress=False)
    assert empty.num_tokens == 0
    with pytest.raises(MoelensError, match="no tokens"):
        empty.indices(empty.layers[0])


def test_a_cache_object_whose_folder_a_later_collection_replaced_says_so(model, tmp_path):
    """Two corpora collected into one folder: the first cache object read the second corpus's shards under its own
    metadata (same shard sizes), or called its intact folder damaged (other sizes)."""
    folder = tmp_path / "routing"
    first = analysis.collect_routing(model, torch.arange(4, 68).reshape(4, 16), folder=folder, progress=False)
    first_ids = first.token_ids()
    for later in (torch.arange(4, 68).reshape(2, 32).flip(-1), torch.arange(4, 44).reshape(2, 20)):
        analysis.collect_routing(model, later, folder=folder, progress=False)
        with pytest.raises(MoelensError, match=r"was replaced after this cache object opened it .* Open the folder "
                                               r"again \(RoutingCache.load\(folder\)\)"):
            first.token_ids()
        with pytest.raises(MoelensError, match=r"was replaced after this cache object opened it"):
            first.save(folder)  # "saved" into its own folder, which holds the other corpus now
    assert torch.equal(RoutingCache.load(folder).token_ids(), torch.arange(4, 44).reshape(2, 20).flatten())
    again = analysis.collect_routing(model, torch.arange(4, 68).reshape(4, 16), folder=tmp_path / "other", progress=False)
    assert torch.equal(again.token_ids(), first_ids)



def test_a_cache_object_whose_folder_was_deleted_or_damaged_says_so(model, tmp_path):
    """A loaded cache whose folder (or routing.json) was deleted, or whose routing.json was damaged, said a later
    collection had replaced it."""
    import shutil

    spoiled = ((lambda folder: (folder / META_FILE).write_text("{not json"), r"routing\.json' is damaged"),
               (lambda folder: (folder / META_FILE).unlink(), r"is gone: routing\.json was deleted after"),
               (shutil.rmtree, r"is gone: its folder was deleted after"))
    for case, (spoil, message) in enumerate(spoiled):
        folder = tmp_path / f"routing{case}"
        analysis.collect_routing(model, token_corpus(3), folder=folder, progress=False)
        lazy = RoutingCache.load(folder)
        spoil(folder)
        with pytest.raises(MoelensError, match=message):
            lazy.token_ids()

def test_a_cache_opened_by_a_relative_folder_keeps_reading_it_from_elsewhere(model, tmp_path, monkeypatch):
    (tmp_path / "project").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "project")
    cache = analysis.collect_routing(model, token_corpus(3), folder="routing", progress=False)
    expected = cache.token_ids()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert torch.equal(cache.token_ids(), expected)
    assert cache._folder == tmp_path / "project" / "routing"


def test_a_folder_named_from_the_home_folder_is_expanded(model, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    cache = analysis.collect_routing(model, token_corpus(3), folder="~/routing", progress=False)
    assert (tmp_path / "home" / "routing" / META_FILE).is_file() and not (tmp_path / "~").exists()
    assert torch.equal(RoutingCache.load("~/routing").token_ids(), cache.token_ids())
    copy = cache.save("~/copy")
    assert copy == tmp_path / "home" / "copy" and (copy / META_FILE).is_file()


def test_a_cache_saved_before_collection_ids_loads_and_notices_a_replacement(model, tmp_path):
    """A routing.json and shards written before moelens marked them with a collection id load and read as before,
    and a later collection into their folder is noticed as well."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "old"
    analysis.collect_routing(model, token_corpus(3), folder=folder, progress=False)
    meta = json.loads((folder / META_FILE).read_text())
    del meta["collection"]
    (folder / META_FILE).write_text(json.dumps(meta))
    for entry in meta["shards"]:
        save_file(load_file(str(folder / entry["file"])), str(folder / entry["file"]))  # no metadata
    old = RoutingCache.load(folder)
    expected = torch.cat([torch.tensor(text) for text in token_corpus(3)])
    assert torch.equal(old.token_ids().long(), expected)
    analysis.collect_routing(model, token_corpus(3, seed=4), folder=folder, progress=False)
    with pytest.raises(MoelensError, match=r"was replaced after this cache object opened it"):
        old.token_ids()


def test_editing_a_shard_handed_out_leaves_the_cache_as_collected(model, tmp_path):
    """`shards()` hands out the caller's own shards, in memory as from disk: zeroing every expert index of one
    leaves the usage counts (from the cached indices, counted by hand) as they were."""
    cache = analysis.collect_routing(model, token_corpus(), batch_size=4)
    layer = cache.layers[0]

    def counts_by_hand() -> list[int]:
        indices = cache.indices(layer).flatten().tolist()
        return [indices.count(expert) for expert in range(cache.num_experts[layer])]

    before = counts_by_hand()
    assert before[0] < sum(before)
    for folder in (None, tmp_path / "saved"):
        source = cache if folder is None else RoutingCache.load(cache.save(folder))
        for shard in source.shards():
            shard.indices[layer].zero_()
            shard.token_ids.zero_()
        assert counts_by_hand() == before
        assert analysis.expert_usage(source).counts[0].tolist() == before  # row 0: the first layer


def rewrite_shard(path: Path, change: Callable[[dict[str, torch.Tensor]], object]) -> None:
    """Rewrite the shard file ``path`` with ``change`` applied to its tensors (name -> tensor), keeping its metadata."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), framework="pt") as file:
        metadata = file.metadata()
    tensors = load_file(str(path))
    change(tensors)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(path), metadata=metadata)


@pytest.mark.parametrize("change, problem", [
    pytest.param(lambda t: t.pop("weights.1"), r"holds weights of layers \[0, 2, 3\]", id="no weights.1"),
    pytest.param(lambda t: t.update({"indices.0": t["indices.0"][:-2]}), r"indices\.0 has shape \[7, 2\]",
                 id="indices.0 two rows short"),
    pytest.param(lambda t: t["indices.0"].__setitem__((0, 0), 77), r"indices\.0 hold expert 77",
                 id="indices.0 holds expert 77"),
    pytest.param(lambda t: t.update({"logits.0": t["logits.0"][:, :2]}), r"logits\.0 .* shape \[9, 2\]",
                 id="logits.0 of 2 columns"),
])
def test_a_shard_that_does_not_hold_what_routing_json_lists_is_refused_by_name(model, tmp_path, change, problem):
    """A shard lacking a layer's tensor, or holding one of the wrong rows, columns or experts, was accepted: analyses
    then raised a bare KeyError or IndexError deep inside, or (too few logit columns) served [T, 2] logits of an
    E=8 layer. Ground truth: the tensor this test took out of or spoiled in the shard file."""
    folder = tmp_path / "routing"
    analysis.collect_routing(model, [[5, 6, 7, 8, 9, 10], [11, 12, 13]], logits=True, folder=folder, progress=False)
    cache = RoutingCache.load(folder)
    assert cache.num_experts[0] == 8 and cache.top_k[0] == 2 and cache.num_tokens == 9
    assert analysis.expert_usage(cache).counts.sum() == 9 * 2 * len(cache.layers)  # intact, it reads
    shard = folder / "shard-00000.safetensors"
    rewrite_shard(shard, change)
    for read in (lambda: RoutingCache.load(folder).logits(0), lambda: analysis.expert_usage(RoutingCache.load(folder)),
                 lambda: RoutingCache.load(folder).weights(1)):
        with pytest.raises(MoelensError, match=rf"file '{re.escape(str(shard))}' is damaged \(.*{problem}"):
            read()


@pytest.mark.parametrize("entry", ["num_experts", "top_k", "score"])
def test_a_routing_json_lacking_a_layers_entry_is_refused_by_name(model, tmp_path, entry):
    """A routing.json whose num_experts, top_k or score lacks one of its layers loaded, and analyses raised a bare
    KeyError. Ground truth: the entry this test deleted from the file."""
    folder = tmp_path / "routing"
    analysis.collect_routing(model, [[5, 6, 7, 8]], logits=True, folder=folder, progress=False)
    meta = json.loads((folder / META_FILE).read_text())
    del meta[entry]["1"]
    (folder / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(MoelensError, match=rf"file '{re.escape(str(folder / META_FILE))}' is damaged \(no {entry} entry for layer 1\)"):
        RoutingCache.load(folder)


def test_a_shard_copied_in_from_another_cache_is_refused_by_name(model, tmp_path):
    """A freshly loaded folder holding a shard of another collection said the cache 'was replaced after this cache
    object opened it' and to open the folder again, which failed the same way, naming the folder and not the shard.
    Ground truth: the shard file this test copied over from another cache."""
    import shutil

    mine, other = tmp_path / "mine", tmp_path / "other"
    analysis.collect_routing(model, [[5, 6, 7, 8]], folder=mine, progress=False)
    analysis.collect_routing(model, [[9, 10, 11, 12]], folder=other, progress=False)
    shard = mine / "shard-00000.safetensors"
    shutil.copy(other / shard.name, shard)
    for _ in range(2):  # opening again says the same: the shard is what is wrong
        with pytest.raises(MoelensError, match=rf"file '{re.escape(str(shard))}' is damaged \(a collection other than the one "
                                               r"routing\.json lists wrote it") as raised:
            RoutingCache.load(mine).token_ids()
        assert "replaced" not in str(raised.value)


@pytest.mark.parametrize("format, message", [
    (2, r"has format 2; this moelens reads format 1: collect the routing again with this moelens .* or read the cache "
        r"with the moelens version that wrote it"),
    (None, r"is not a moelens routing cache's routing\.json \(no format recorded in it\)"),
    (True, r"is not a moelens routing cache's routing\.json \(its format is True, not a format number\)"),
], ids=["format 2", "no format", "format true"])
def test_a_routing_json_of_another_format_or_none_says_what_to_do(model, tmp_path, format, message):
    """A routing.json of another format said only 'has format 2; this moelens reads format 1.', one with no format
    (not a moelens cache) 'has format None', and one whose format is true (== 1 in Python) was read as format 1."""
    folder = tmp_path / "routing"
    analysis.collect_routing(model, [[5, 6, 7, 8]], folder=folder, progress=False)
    meta = json.loads((folder / META_FILE).read_text())
    meta.pop("format")
    if format is not None:
        meta["format"] = format
    (folder / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(MoelensError, match=rf"'{re.escape(str(folder / META_FILE))}' {message}"):
        RoutingCache.load(folder)


def spoil_shard(name: str, value: object) -> Callable[[Path], None]:
    """Set element 0 of the shard tensor ``name`` of the cache in a folder to ``value`` (a float: make it float)."""
    def spoil(folder: Path) -> None:
        def change(tensors: dict[str, torch.Tensor]) -> None:
            if isinstance(value, float):
                tensors[name] = tensors[name].float()
            tensors[name][0] = value
        rewrite_shard(folder / "shard-00000.safetensors", change)
    return spoil


def spoil_meta(change: Callable[[dict], object]) -> Callable[[Path], None]:
    """Apply ``change`` to the routing.json of the cache in a folder."""
    def spoil(folder: Path) -> None:
        meta = json.loads((folder / META_FILE).read_text())
        change(meta)
        (folder / META_FILE).write_text(json.dumps(meta))
    return spoil


@pytest.mark.parametrize("spoil, spoiled, problem", [
    pytest.param(spoil_shard("token_ids", -3), "shard-00000.safetensors",
                 r"its token_ids holds -3, where token ids are 0 or more", id="token id -3"),
    pytest.param(spoil_shard("token_ids", 5.5), "shard-00000.safetensors",
                 r"its token_ids are torch\.float32, not integers", id="float token ids"),
    pytest.param(spoil_shard("text_index", 7), "shard-00000.safetensors",
                 r"its text_index holds 7, where routing\.json's num_texts \(how many corpus items were read\) is 2",
                 id="text index 7 of 2 texts"),
    pytest.param(spoil_meta(lambda meta: meta.update(num_texts=1)), "shard-00000.safetensors",
                 r"its text_index holds 1, where routing\.json's num_texts .* is 1", id="num_texts 1 of 2 texts"),
    pytest.param(spoil_shard("position", -1), "shard-00000.safetensors",
                 r"its position holds -1, where positions in a corpus item are 0 or more", id="position -1"),
    pytest.param(spoil_meta(lambda meta: meta.update(num_texts=-2)), META_FILE,
                 r"its num_texts is -2, not a count \(an integer, 0 or more\)", id="num_texts -2"),
    pytest.param(spoil_meta(lambda meta: meta.update(num_texts="2")), META_FILE,
                 r"its num_texts is '2', not a count", id="num_texts a string"),
    pytest.param(spoil_meta(lambda meta: meta["shards"][0].update(tokens=-5)), META_FILE,
                 r"its tokens entry of the shard 'shard-00000\.safetensors' is -5, not a count", id="tokens -5"),
    pytest.param(spoil_meta(lambda meta: meta["shards"].append(dict(meta["shards"][0]))), META_FILE,
                 r"it lists the shard file 'shard-00000\.safetensors' more than once", id="a shard listed twice"),
])
def test_a_cache_whose_token_sources_or_counts_are_out_of_range_is_refused_by_name(model, tmp_path, spoil, spoiled,
                                                                                   problem):
    """Shard checks read only the shapes of token_ids, text_index and position, and routing.json's counts were taken
    as they came: a negative token id crashed top_tokens in torch.bincount, a text index past num_texts crashed
    specialisation(per="text") with an IndexError, a shard listed twice counted every token twice, and a negative
    tokens entry made num_tokens negative. Ground truth: the value this test wrote into the file (the intact cache
    holds 9 tokens of 2 texts)."""
    folder = tmp_path / "routing"
    analysis.collect_routing(model, [[5, 6, 7, 8, 9, 10], [11, 12, 13]], folder=folder, progress=False)
    intact = RoutingCache.load(folder)
    assert (intact.num_tokens, intact.num_texts, intact.num_shards) == (9, 2, 1)
    assert intact.text_index().tolist() == [0] * 6 + [1] * 3 and intact.position().tolist() == [*range(6), *range(3)]
    assert analysis.expert_usage(intact).counts.sum() == 9 * 2 * len(intact.layers)  # intact, it reads
    spoil(folder)
    reads = (lambda cache: analysis.top_tokens(cache, 0), lambda cache: analysis.expert_usage(cache),
             lambda cache: analysis.specialisation(cache, torch.tensor([0, 1]), per="text"),
             lambda cache: (cache.num_tokens, cache.position()))
    for read in reads:
        with pytest.raises(MoelensError, match=rf"file '{re.escape(str(folder / spoiled))}' is damaged \({problem}"):
            read(RoutingCache.load(folder))


def test_dense_weights_put_each_slot_in_its_experts_column_and_skipped_slots_nowhere():
    """By hand: token 0 routed to experts 2 and 0, token 1 to expert 1 and a slot that ran no expert (zaya's skip
    class, `SKIPPED`), whose weight lands in no column."""
    from moelens.analysis.cache import SKIPPED, Shard

    shard = Shard(token_ids=torch.tensor([5, 6], dtype=torch.int32), text_index=torch.zeros(2, dtype=torch.int32),
                  position=torch.arange(2, dtype=torch.int32),
                  indices={3: torch.tensor([[2, 0], [1, SKIPPED]], dtype=torch.int16)},
                  weights={3: torch.tensor([[0.75, 0.25], [0.5, 0.5]], dtype=torch.float16)})
    cache = RoutingCache(layers=[3], num_experts={3: 4}, top_k={3: 2}, score={3: "softmax"}, num_texts=1,
                         _memory=[shard])
    assert cache.dense_weights(3).tolist() == [[0.25, 0.0, 0.75, 0.0], [0.0, 0.5, 0.0, 0.0]]
    with pytest.raises(MoelensError, match="layer"):
        cache.dense_weights(0)


def test_the_repr_says_what_the_cache_holds_and_where_in_one_line(model, tmp_path):
    """The dataclass' own repr printed every per-layer dict and no token count: the repr names the family, the tokens
    and texts, the layers, E and k (one number where every layer has the same), the logits, and memory or the folder,
    each against the cache's own attributes; it reads nothing from the folder and never raises."""
    corpus = token_corpus(5)
    memory = analysis.collect_routing(model, corpus, batch_size=2, max_length=8, shard_tokens=20, logits=True,
                                      progress=False)
    config = model._module.config
    experts, k = config.num_local_experts, config.num_experts_per_tok
    text = repr(memory)
    assert text == (f"RoutingCache(mixtral, {memory.num_tokens} tokens in {memory.num_texts} texts, layers "
                    f"{memory.layers}, E={experts}, k={k}, logits=True, in memory, {memory.num_shards} shards)")
    assert memory.num_texts == len(corpus) and memory.num_shards > 1 and "\n" not in text

    folder = memory.save(tmp_path / "cache")
    loaded = RoutingCache.load(folder)
    assert repr(loaded) == (f"RoutingCache(mixtral, {loaded.num_tokens} tokens in {loaded.num_texts} texts, layers "
                            f"{loaded.layers}, E={experts}, k={k}, logits=True, folder {str(folder.absolute())!r}, "
                            f"{loaded.num_shards} shards)")
    for shard in folder.glob("shard-*.safetensors"):
        shard.unlink()
    assert repr(loaded).startswith("RoutingCache(mixtral, ")  # counts from routing.json: no shard is read

    by_hand = RoutingCache(layers=[0, 2], num_experts={0: 4, 2: 8}, top_k={0: 2, 2: 2},
                           score={0: "softmax", 2: "softmax"}, num_texts=1)
    assert repr(by_hand) == ("RoutingCache(0 tokens in 1 text, layers [0, 2], E={0: 4, 2: 8}, k=2, logits=False, "
                             "in memory, 0 shards)")
    broken = RoutingCache(layers=None, num_experts=None, top_k=None, score=None)
    assert repr(broken).startswith("RoutingCache(")


def test_float8_storage_is_refused_before_the_forward():
    """float8 passed the dtype check, ran the first forward, then failed inside torch ("isinf" not implemented for
    Float8_e4m3fn); float8_e5m2 stored weights to about 5e-2."""
    from moelens.analysis.collect import check_storage_dtype

    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        with pytest.raises(MoelensError, match="too few bits"):
            check_storage_dtype(dtype)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        check_storage_dtype(dtype)
