"""Samplers, token streams, corpus and tokenizer: who reads what, exactly once, and how a run resumes."""
import hashlib
import math

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from nanodist.check import check_sampler_exactly_once
from nanodist.data import (CharTokenizer, ShardedSampler, TokenStream, generate_corpus, load_corpus,
                           train_val_split)
from nanodist.testing import spawn


def per_rank(n, world, **kw):
    return [list(ShardedSampler(range(n), rank=r, world_size=world, **kw)) for r in range(world)]


# ----------------------------------------------------------------------------- ShardedSampler

@pytest.mark.parametrize("world", [2, 3, 4])
def test_sampler_reads_every_sample_once_for_uneven_sizes(world):
    for n in (1, world - 1, world, world + 1, 10, 11, 13, 2 * world + 1):
        if n < 1:
            continue
        for shuffle in (False, True):
            for contiguous in (False, True):
                for drop_last in (False, True):
                    kw = dict(shuffle=shuffle, contiguous=contiguous, drop_last=drop_last, seed=5)
                    if drop_last and n < world:
                        continue  # an error, tested below
                    lists = per_rank(n, world, **kw)
                    cov = check_sampler_exactly_once(lists, n, drop_last=drop_last)
                    per = n // world if drop_last else math.ceil(n / world)
                    assert cov.per_rank == (per,) * world
                    assert cov.dropped == (n - per * world if drop_last else 0)
                    assert cov.padded == (0 if drop_last else per * world - n)


@pytest.mark.parametrize("drop_last", [False, True])
def test_unshuffled_strided_order_matches_torch_distributed_sampler(drop_last):
    for n, world in ((10, 3), (11, 4), (2, 3) if not drop_last else (7, 2)):
        ours = per_rank(n, world, shuffle=False, drop_last=drop_last)
        theirs = [list(DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=False, drop_last=drop_last))
                  for r in range(world)]
        assert ours == theirs


def test_contiguous_versus_strided_and_padding_counts():
    assert per_rank(10, 2, shuffle=False) == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    assert per_rank(10, 2, shuffle=False, contiguous=True) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert per_rank(10, 3, shuffle=False) == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]  # padded with 0, 1
    assert per_rank(10, 3, shuffle=False, drop_last=True) == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    assert per_rank(10, 3, shuffle=False, contiguous=True, drop_last=True) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert len(ShardedSampler(range(10), rank=2, world_size=3)) == 4
    assert len(ShardedSampler(range(10), rank=2, world_size=3, drop_last=True)) == 3


def test_set_epoch_reshuffles_identically_on_every_rank():
    samplers = [ShardedSampler(range(50), rank=r, world_size=3, seed=7) for r in range(3)]
    epoch0 = [list(s) for s in samplers]
    for s in samplers:
        s.set_epoch(1)
    epoch1 = [list(s) for s in samplers]
    assert epoch0 != epoch1
    assert len({tuple(s.global_order()) for s in samplers}) == 1  # one permutation, shared by all ranks
    check_sampler_exactly_once(epoch1, 50)
    assert [list(s) for s in samplers] == epoch1  # same epoch, same order
    other_seed = ShardedSampler(range(50), rank=0, world_size=3, seed=8)
    other_seed.set_epoch(1)
    assert list(other_seed) != epoch1[0]
    assert ShardedSampler(range(50), rank=0, world_size=3, seed=7).global_order(1) == samplers[0].global_order()


def test_sampler_errors_name_the_numbers():
    with pytest.raises(ValueError, match=r"rank=3 is out of range for world_size=3: use 0\.\.2"):
        ShardedSampler(range(10), rank=3, world_size=3)
    with pytest.raises(ValueError, match="world_size must be an integer >= 1, got 0"):
        ShardedSampler(range(10), rank=0, world_size=0)
    with pytest.raises(ValueError, match="dataset of 3 samples is smaller than world size 4.*drop_last=False"):
        ShardedSampler(range(3), rank=0, world_size=4, drop_last=True)
    with pytest.raises(ValueError, match="empty dataset"):
        ShardedSampler([], rank=0, world_size=1)


def test_sampler_without_process_group_is_a_world_of_one():
    assert not dist.is_initialized()
    s = ShardedSampler(range(5), shuffle=False)
    assert (s.rank, s.world_size, list(s)) == (0, 1, [0, 1, 2, 3, 4])


def test_sampler_state_dict_resumes_exactly():
    a = ShardedSampler(range(23), rank=1, world_size=2, seed=3)
    a.set_epoch(2)
    it = iter(a)
    head = [next(it) for _ in range(4)]
    state = a.state_dict()
    rest = list(it)
    b = ShardedSampler(range(23), rank=1, world_size=2, seed=3)
    b.load_state_dict(state)
    b.set_epoch(2)  # the usual loop calls this again after resuming: it must keep the position
    assert head + list(b) == a.indices(2) and list(b) == a.indices(2)  # a second pass starts from the top
    b.load_state_dict(state)
    assert list(b) == rest
    b.load_state_dict(state)
    b.set_epoch(3)  # a new epoch starts from its beginning
    assert list(b) == a.indices(3)
    with pytest.raises(ValueError, match="saved with seed=3 but this ShardedSampler has seed=4"):
        ShardedSampler(range(23), rank=1, world_size=2, seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="mid-epoch.*world size 3.*saved at world size 2"):
        ShardedSampler(range(23), rank=1, world_size=3, seed=3).load_state_dict(state)
    ShardedSampler(range(23), rank=1, world_size=3, seed=3).load_state_dict({**state, "position": 0})


def test_sampler_drives_a_dataloader():
    s = ShardedSampler(list(range(10)), rank=0, world_size=2, shuffle=False)
    batches = [b.tolist() for b in DataLoader(list(range(100, 110)), batch_size=2, sampler=s)]
    assert batches == [[100, 102], [104, 106], [108]]


# ----------------------------------------------------------------------------- TokenStream

def take(stream, k):
    return [next(stream) for _ in range(k)]


def test_token_stream_ranks_read_disjoint_windows_and_y_is_x_shifted():
    T, B, W = 8, 4, 3
    tokens = torch.arange(1000)  # token value = position, so a window is known by its first token
    streams = [TokenStream(tokens, batch_size=B, block_size=T, rank=r, world_size=W, seed=1) for r in range(W)]
    bpe = streams[0].batches_per_epoch
    assert bpe == (999 // T) // W // B == 10
    for epoch in range(2):
        starts = []
        for s in streams:
            for x, y in take(s, bpe):
                assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.int64
                assert torch.equal(y, x + 1)
                assert torch.equal(x[:, 0] % T, torch.zeros(B, dtype=torch.long))  # windows start at i*T
                starts += (x[:, 0] // T).tolist()
        assert len(starts) == len(set(starts)) == W * bpe * B  # disjoint across ranks
        assert all(s.epoch == epoch for s in streams)
    unshuffled = TokenStream(tokens, batch_size=2, block_size=T, rank=1, world_size=W, shuffle=False)
    assert (next(unshuffled)[0][:, 0] // T).tolist() == [1, 4]  # windows rank, rank + W, ...


def test_token_stream_is_endless_and_reshuffles_each_epoch():
    s = TokenStream(torch.arange(200), batch_size=2, block_size=10, rank=0, world_size=1, seed=0)
    assert s.batches_per_epoch == 9
    first = torch.cat([x for x, _ in take(s, 9)])
    second = torch.cat([x for x, _ in take(s, 9)])
    assert s.epoch == 1 and not torch.equal(first, second)
    for x in (first, second):  # 18 of the 19 windows each epoch; the one left over changes with the shuffle
        assert len(set(x[:, 0].tolist())) == 18 and set(x[:, 0].tolist()) <= set(range(0, 190, 10))


def test_token_stream_state_dict_resumes_bit_exactly():
    text_tokens = torch.tensor(CharTokenizer(generate_corpus(5000)).encode(generate_corpus(5000)), dtype=torch.int16)
    kw = dict(batch_size=3, block_size=16, rank=1, world_size=2, seed=9)
    a = TokenStream(text_tokens, **kw)
    x, y = next(a)
    assert torch.equal(y[:, :-1], x[:, 1:]) and x.dtype == torch.int64
    for stop in (6, 48, 51):  # mid-epoch, just before and just after an epoch boundary (52 per epoch)
        a = TokenStream(text_tokens, **kw)
        take(a, stop)
        state = a.state_dict()
        expected = take(a, 5)
        b = TokenStream(text_tokens, **kw)
        b.load_state_dict(state)
        got = take(b, 5)
        assert all(torch.equal(e[0], g[0]) and torch.equal(e[1], g[1]) for e, g in zip(expected, got))
    with pytest.raises(ValueError, match="saved with batch_size=3 but this TokenStream has batch_size=4"):
        TokenStream(text_tokens, **{**kw, "batch_size": 4}).load_state_dict(state)


@pytest.mark.parametrize("new_world", [1, 3])
def test_token_stream_resumes_mid_epoch_at_another_world_size_reading_every_window_once(new_world):
    """The state is a global cursor: ranks of another world size share out the rest of the epoch."""
    tokens, B, T = torch.arange(2000), 3, 8  # token value = position: a window is known by its first token
    old = [TokenStream(tokens, batch_size=B, block_size=T, rank=r, world_size=2, seed=5) for r in range(2)]
    read = []
    for s in old:
        read += [w for x, _ in take(s, 7) for w in (x[:, 0] // T).tolist()]
    state = old[0].state_dict()
    assert state == old[1].state_dict() and state["consumed"] == 7 * 2 * B  # one cursor for every rank
    new = [TokenStream(tokens, batch_size=B, block_size=T, rank=r, world_size=new_world, seed=5)
           for r in range(new_world)]
    for s in new:
        s.load_state_dict(state)
        while s.n_windows - s.consumed >= s.step_windows:  # the rest of epoch 0
            read += [w for x, _ in take(s, 1) for w in (x[:, 0] // T).tolist()]
        assert s.epoch == 0
    order = old[0]._epoch_order(0).tolist()
    assert len(read) == len(set(read)), "a window was read twice"
    assert sorted(read) == sorted(order[:len(read)])  # exactly the front of the epoch's order, each once
    assert old[0].n_windows - len(read) < new_world * B  # only the tail too short for a whole step is skipped


def test_token_stream_too_small_names_tokens_windows_and_world_size():
    with pytest.raises(ValueError, match=r"100 tokens make 12 windows .* world size 4 each rank gets 3 windows, "
                                         r"fewer than batch_size=4.*at least 129 tokens"):
        TokenStream(torch.arange(100), batch_size=4, block_size=8, rank=0, world_size=4)
    TokenStream(torch.arange(129), batch_size=4, block_size=8, rank=3, world_size=4)  # exactly enough
    with pytest.raises(ValueError, match="1-D sequence of integer token ids"):
        TokenStream(torch.rand(100), batch_size=1, block_size=8, rank=0, world_size=1)


# ----------------------------------------------------------------------------- corpus, tokenizer

def test_builtin_corpus_is_fixed_and_round_trips():
    text = load_corpus()
    assert text == generate_corpus() and len(text) == 200_000
    # Reference results are compared across machines and versions: the built-in text must never drift.
    assert hashlib.sha256(text.encode()).hexdigest()[:16] == "db704e6e1696fb56"
    assert generate_corpus(1000, seed=1) != generate_corpus(1000, seed=0)
    tok = CharTokenizer(text)
    assert tok.chars == "".join(sorted(set(text))) and tok.vocab_size == len(tok.chars)
    ids = tok.encode(text[:500])
    assert tok.decode(ids) == text[:500] == tok.decode(torch.tensor(ids))
    assert CharTokenizer(tok.chars).encode(text[:500]) == ids
    with pytest.raises(ValueError, match="character '€' is not in this tokenizer's vocabulary"):
        tok.encode("5 €")
    with pytest.raises(ValueError, match="outside this tokenizer's vocabulary"):
        tok.decode([0, -1, tok.vocab_size])
    train, val = train_val_split(torch.tensor(ids), 0.1)
    assert len(train) == 450 and torch.equal(torch.cat([train, val]), torch.tensor(ids))


def test_load_corpus_reads_files_and_explains_bad_ones(tmp_path):
    good = tmp_path / "good.txt"
    good.write_text("hello world. " * 100, encoding="utf-8")
    assert load_corpus(good) == "hello world. " * 100
    assert load_corpus(str(good), min_chars=10).startswith("hello")
    with pytest.raises(FileNotFoundError, match="missing.txt' does not exist"):
        load_corpus(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        load_corpus(tmp_path / "empty.txt")
    (tmp_path / "short.txt").write_text("too short")
    with pytest.raises(ValueError, match="has 9 characters, fewer than min_chars=1000"):
        load_corpus(tmp_path / "short.txt")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 500)
    with pytest.raises(ValueError, match="not UTF-8"):
        load_corpus(tmp_path / "latin1.txt")
    with pytest.raises(ValueError, match="is a directory"):
        load_corpus(tmp_path)


# ----------------------------------------------------------------------------- real processes

def _default_group_worker(rank, world_size, store_path):
    # Replace nanodist's group with a plain torch one: data.py must not care who made the default group.
    import nanodist
    nanodist.shutdown()
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    try:
        sampler = ShardedSampler(range(11), seed=2)
        sampler.set_epoch(1)
        coverage = check_sampler_exactly_once(sampler)  # collective: gathers every rank's indices
        stream = TokenStream(torch.arange(500), batch_size=2, block_size=8)
        windows = [(x[:, 0] // 8).tolist() for x, _ in take(stream, 3)]
        return sampler.rank, sampler.world_size, list(sampler), coverage, windows
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_defaults_come_from_any_default_process_group(tmp_path):
    outs = spawn(_default_group_worker, world_size=3, args=(str(tmp_path / "store"),), timeout=90)
    assert [(o[0], o[1]) for o in outs] == [(0, 3), (1, 3), (2, 3)]
    assert [o[2] for o in outs] == [ShardedSampler(range(11), rank=r, world_size=3, seed=2).indices(1)
                                    for r in range(3)]
    assert all(o[3].per_rank == (4, 4, 4) and o[3].padded == 1 for o in outs)
    windows = [w for o in outs for batch in o[4] for w in batch]
    assert len(windows) == len(set(windows)) == 3 * 3 * 2
