"""Data for data parallelism: who reads which sample, a sharded token stream, and a corpus that needs no download.

    text = load_corpus()                      # built-in generated stories, or load_corpus("my.txt")
    tok = CharTokenizer(text)
    train, val = train_val_split(torch.tensor(tok.encode(text)))
    stream = TokenStream(train, batch_size=16, block_size=64)     # this rank's share, forever
    x, y = next(stream)                                            # (16, 64) int64, y is x shifted by one

    sampler = ShardedSampler(dataset, seed=0)  # for map-style datasets and torch's DataLoader
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for i in sampler: ...

The two promises data parallelism rests on: ranks read disjoint samples, and every rank takes the same
number of steps (a rank with one batch fewer would leave the others waiting in an all-reduce forever).
Both objects resume exactly from `state_dict()`, and all their randomness comes from a torch.Generator
seeded by (seed, epoch), the same on every rank, so no global random state is touched.
"""
from __future__ import annotations

import functools
import math
from pathlib import Path

import torch
from torch.utils.data import Sampler

from .group import Group

# Seeds for (seed, epoch) pairs are seed * stride + epoch: unlike seed + epoch (torch's DistributedSampler),
# seed=1 at epoch 0 does not replay seed=0 at epoch 1.
_EPOCH_SEED_STRIDE = 1_000_003


def _epoch_generator(seed: int, epoch: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * _EPOCH_SEED_STRIDE + epoch) % 2**63)


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Explicit values win; missing ones come from the default process group (or a world of one)."""
    if rank is None or world_size is None:
        world = Group.world()
        rank = world.rank if rank is None else rank
        world_size = world.size if world_size is None else world_size
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r} is out of range for world_size={world_size}: use 0..{world_size - 1}")
    return rank, world_size


def _check_state(kind: str, saved: dict, current: dict) -> None:
    for key, value in current.items():
        if key in saved and saved[key] != value:
            raise ValueError(f"cannot load {kind} state: it was saved with {key}={saved[key]!r} but this {kind} has "
                             f"{key}={value!r}. Build the {kind} with the same arguments as the saved run.")


# ----------------------------------------------------------------------------- sampler

class ShardedSampler(Sampler[int]):
    """This rank's indices of a map-style dataset (anything with `len()`), one epoch per iteration.

    - Every rank yields the same number of indices, `len(sampler)`. With drop_last=False the global order is
      padded by repeating indices from its start (as torch's DistributedSampler does); with drop_last=True
      its tail is dropped. Apart from that padding, ranks never share an index within an epoch.
    - shuffle permutes all indices with a generator seeded by (seed, epoch): identical on every rank, so pass
      the same `seed` everywhere (not `DistInfo.data_seed`, which differs per rank). Call set_epoch(e) before
      each epoch for a new order.
    - strided (default): rank r takes positions r, r + W, r + 2W, ... of the order; contiguous=True gives
      rank r one block of len(sampler) consecutive positions instead (better locality for memory-mapped data).
    - rank and world_size default to the default process group's (world size 1 without one).
    - state_dict()/load_state_dict() record the epoch and how many indices this epoch has been handed out,
      so iteration after a load continues exactly where the saved one stopped. A DataLoader with worker
      processes draws indices a few batches ahead of the training step: then save
      `{**sampler.state_dict(), "position": steps_done * batch_size}` instead.
    """

    def __init__(self, dataset, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 rank: int | None = None, world_size: int | None = None, contiguous: bool = False):
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        self.dataset_len = len(dataset)
        self.shuffle, self.seed, self.drop_last, self.contiguous = shuffle, seed, drop_last, contiguous
        n, W = self.dataset_len, self.world_size
        if n == 0:
            raise ValueError("ShardedSampler got an empty dataset (len 0): there is nothing to iterate")
        if drop_last and n < W:
            raise ValueError(f"dataset of {n} samples is smaller than world size {W}: with drop_last=True every "
                             f"rank would get 0 samples. Use drop_last=False (pads by repeating samples), fewer "
                             f"ranks, or a dataset of at least {W} samples.")
        self.num_samples = n // W if drop_last else math.ceil(n / W)  # per rank, every rank alike
        self.total_size = self.num_samples * W
        self.epoch = 0
        self._position = 0  # indices handed out so far in this epoch
        self._resume_from = 0  # where the next __iter__ starts (non-zero only after load_state_dict)

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch (and so the shuffled order). Setting the epoch the sampler is already in keeps a
        position restored by load_state_dict, so a resumed loop may call set_epoch(saved_epoch) as usual."""
        if epoch != self.epoch:
            self.epoch, self._position, self._resume_from = epoch, 0, 0

    def global_order(self, epoch: int | None = None) -> list[int]:
        """All ranks' indices for an epoch, padded or trimmed to total_size, before the split among ranks."""
        n = self.dataset_len
        if self.shuffle:
            order = torch.randperm(n, generator=_epoch_generator(self.seed, self.epoch if epoch is None else epoch))
            order = order.tolist()
        else:
            order = list(range(n))
        if self.total_size <= n:
            return order[:self.total_size]
        pad = self.total_size - n  # fewer than W samples short; repeat from the start, wrapping if W > n
        return order + (order * math.ceil(pad / n))[:pad]

    def indices(self, epoch: int | None = None) -> list[int]:
        """This rank's full list of indices for an epoch (default: the current one). Does not move the position."""
        order = self.global_order(epoch)
        if self.contiguous:
            start = self.rank * self.num_samples
            return order[start:start + self.num_samples]
        return order[self.rank::self.world_size]

    def __iter__(self):
        mine = self.indices()
        start, self._resume_from = self._resume_from, 0
        self._position = start
        for i in range(start, len(mine)):
            self._position = i + 1
            yield mine[i]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self._position, "seed": self.seed, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "contiguous": self.contiguous, "dataset_len": self.dataset_len,
                "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        """Restore epoch and position. The order-defining arguments must match; the world size may differ only
        at an epoch boundary (position 0), since a mid-epoch position means another split of the order."""
        _check_state("ShardedSampler", state, {"seed": self.seed, "shuffle": self.shuffle,
                                               "drop_last": self.drop_last, "contiguous": self.contiguous,
                                               "dataset_len": self.dataset_len})
        position = int(state.get("position", 0))
        if position and state.get("world_size", self.world_size) != self.world_size:
            raise ValueError(f"cannot resume mid-epoch (position {position}) at world size {self.world_size}: the "
                             f"state was saved at world size {state['world_size']}. Resume with the same number "
                             f"of ranks, or from a checkpoint taken at an epoch boundary.")
        if not 0 <= position <= self.num_samples:
            raise ValueError(f"position {position} is outside 0..{self.num_samples} (samples per rank per epoch)")
        self.epoch = int(state["epoch"])
        self._position = self._resume_from = position


# ----------------------------------------------------------------------------- token stream

class TokenStream:
    """Endless (x, y) batches for language modelling, each rank reading disjoint windows of one token stream.

    The stream is cut into n_windows = (len(tokens) - 1) // block_size windows; window i is
    tokens[i*T : i*T + T + 1], so x = its first T tokens and y = its last T (the next-token targets).
    Each epoch, the windows (shuffled with a generator seeded by (seed, epoch) when shuffle=True) are
    dealt out like cards: of the next world_size x batch_size windows of that order, rank r takes
    positions r, r + W, r + 2W, ... So ranks never share a window, all ranks get `batches_per_epoch`
    batches, and the windows left over at the end of an epoch are skipped.

    The position is one global cursor -- (epoch, windows consumed by all ranks in this epoch) -- from
    which every rank derives its own next windows. state_dict() holds it; after load_state_dict, next()
    returns exactly the batch the saved stream would have returned next, and at another world size the
    remaining windows of the epoch are dealt to the new ranks: every window is still read once.
    """

    def __init__(self, tokens, *, batch_size: int, block_size: int, rank: int | None = None,
                 world_size: int | None = None, seed: int = 0, shuffle: bool = True,
                 device: str | torch.device | None = None):
        tokens = torch.as_tensor(tokens)
        if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise ValueError(f"tokens must be a 1-D sequence of integer token ids, got a {tokens.dtype} tensor "
                             f"of shape {tuple(tokens.shape)}")
        if batch_size < 1 or block_size < 1:
            raise ValueError(f"batch_size and block_size must be >= 1, got {batch_size} and {block_size}")
        rank, world_size = _rank_and_world(rank, world_size)
        self.tokens, self.batch_size, self.block_size = tokens, batch_size, block_size
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.device = torch.device(device) if device is not None else None
        self.n_windows = max(len(tokens) - 1, 0) // block_size
        per_rank = self.n_windows // world_size
        self.batches_per_epoch = per_rank // batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"token stream too small: {len(tokens)} tokens make {self.n_windows} windows of block_size+1 = "
                f"{block_size + 1} tokens; at world size {world_size} each rank gets {per_rank} windows, fewer than "
                f"batch_size={batch_size}. Use a longer text (at least {batch_size * world_size * block_size + 1} "
                f"tokens), a smaller batch_size or block_size, or fewer ranks.")
        self._offsets = torch.arange(block_size + 1)
        self.epoch, self.consumed = 0, 0  # the global cursor: windows read by all ranks so far in this epoch
        self._order_epoch, self._order = None, None

    @property
    def step_windows(self) -> int:
        """Windows every batch takes from the global order: one batch for each rank."""
        return self.world_size * self.batch_size

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._order_epoch != epoch:
            order = (torch.randperm(self.n_windows, generator=_epoch_generator(self.seed, epoch)) if self.shuffle
                     else torch.arange(self.n_windows))
            self._order, self._order_epoch = order, epoch
        return self._order

    def window_indices(self, epoch: int | None = None) -> list[int]:
        """The windows this rank reads in a whole epoch (default: the current one), in order, at this world size."""
        order = self._epoch_order(self.epoch if epoch is None else epoch)
        used = self.batches_per_epoch * self.step_windows
        return order[:used][self.rank::self.world_size].tolist()

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.n_windows - self.consumed < self.step_windows:  # not a full batch left for every rank
            self.epoch, self.consumed = self.epoch + 1, 0
        order = self._epoch_order(self.epoch)
        W, B, T = self.world_size, self.batch_size, self.block_size
        windows = order[self.consumed + self.rank:self.consumed + W * B:W]
        chunk = self.tokens[windows[:, None] * T + self._offsets].long()  # (B, T + 1)
        self.consumed += W * B
        x, y = chunk[:, :-1], chunk[:, 1:]
        if self.device is not None:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        return x, y

    def state_dict(self) -> dict:
        """The global cursor and what defines the order; the same on every rank."""
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed, "shuffle": self.shuffle,
                "n_tokens": len(self.tokens), "batch_size": self.batch_size, "block_size": self.block_size,
                "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        """Restore the cursor. Same tokens, sizes and seed needed; any world size (the rest of the epoch is dealt
        to this run's ranks)."""
        _check_state("TokenStream", state, {"seed": self.seed, "shuffle": self.shuffle, "n_tokens": len(self.tokens),
                                            "batch_size": self.batch_size, "block_size": self.block_size})
        epoch, consumed = int(state["epoch"]), int(state["consumed"])
        if not 0 <= consumed <= self.n_windows:
            raise ValueError(f"cursor {consumed} is outside 0..{self.n_windows} (windows per epoch)")
        self.epoch, self.consumed = epoch, consumed


def train_val_split(tokens: torch.Tensor, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a token tensor into (train, val): the last val_fraction of the stream is held out, unshuffled,
    so no validation window overlaps a training window."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    cut = int(len(tokens) * (1.0 - val_fraction))
    return tokens[:cut], tokens[cut:]


# ----------------------------------------------------------------------------- corpus and tokenizer

class _SplitMix64:
    """A 64-bit PRNG in a few lines of integer arithmetic: the built-in corpus must be the same text on every
    machine and Python version, which python's `random.choice` does not promise."""

    _MASK = 2**64 - 1

    def __init__(self, seed: int):
        self.state = seed & self._MASK

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & self._MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & self._MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & self._MASK
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next() % n

    def pick(self, seq):
        return seq[self.below(len(seq))]


_NAMES = ("Ada", "Bruno", "Clara", "Dmitri", "Elif", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kira", "Lev",
          "Mina", "Nils", "Olga", "Pavel", "Rosa", "Tomas", "Vera", "Yusuf")
_ANIMALS = ("fox", "cat", "owl", "goat", "crow", "dog", "hare", "mouse", "bear", "frog", "heron", "badger")
_ADJECTIVES = ("old", "small", "quiet", "clever", "grey", "brave", "sleepy", "hungry", "little", "proud", "kind")
_THINGS = ("key", "lamp", "map", "bell", "coin", "letter", "basket", "rope", "boat", "clock", "apple", "stone")
_PLACES = ("the river", "the mill", "the market", "the old bridge", "the forest", "the harbour", "the hill",
           "the garden", "the tower", "the well", "the bakery", "the school")
# (past tense, base form, past participle)
_VERBS = (("found", "find", "found"), ("carried", "carry", "carried"), ("lost", "lose", "lost"),
          ("mended", "mend", "mended"), ("sold", "sell", "sold"), ("hid", "hide", "hidden"),
          ("painted", "paint", "painted"), ("opened", "open", "opened"), ("took", "take", "taken"),
          ("gave away", "give away", "given away"))
_FEELINGS = ("happy", "tired", "worried", "proud", "angry", "surprised", "calm", "sad")
_WEATHER = ("rain fell on the roofs", "the sun was warm", "the wind was cold", "snow came down",
            "fog covered the valley", "the sky was clear")
_TIMES = ("In the morning", "At noon", "In the evening", "At night", "The next day", "Later", "One day")
_NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
            "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty")


def _someone(rng: _SplitMix64) -> str:
    if rng.below(2):
        return rng.pick(_NAMES)
    return f"the {rng.pick(_ADJECTIVES)} {rng.pick(_ANIMALS)}"


def _sentence(rng: _SplitMix64) -> str:
    a, b = _someone(rng), _someone(rng)
    past, base, participle = rng.pick(_VERBS)
    thing, place = rng.pick(_THINGS), rng.pick(_PLACES)
    a_thing = f"an {thing}" if thing[0] in "aeiou" else f"a {thing}"
    form = rng.below(7)
    if form == 0:
        text = f"{rng.pick(_TIMES)}, {a} {past} {a_thing} near {place}."
    elif form == 1:
        ask = rng.pick((f"Can you help me {base} the {thing}?", f"Where is my {thing}?",
                        f"I will {base} the {thing} at {place}.", f"Did you see {b} at {place}?"))
        text = f"{a} said to {b}, \"{ask}\""
    elif form == 2:
        text = f"{a} was {rng.pick(_FEELINGS)} because {b} had {participle} the {thing}."
    elif form == 3:  # arithmetic in words: structure a bigger model can learn, a small one only partly
        x, y = 2 + rng.below(9), rng.below(10)
        text = f"{a} counted {_NUMBERS[x]} {thing}s and then {_NUMBERS[y]} more, so there were {_NUMBERS[x + y]}."
    elif form == 4:
        text = f"{rng.pick(_TIMES)}, {rng.pick(_WEATHER)}."
    elif form == 5:
        text = f"\"{rng.pick(('Yes', 'No', 'Maybe'))}, {rng.pick(_NAMES)},\" said {a}."
    else:
        text = f"When {a} {past} the {thing}, {b} went to {place}."
    return text[0].upper() + text[1:]


@functools.lru_cache(maxsize=4)
def generate_corpus(n_chars: int = 200_000, seed: int = 0) -> str:
    """Deterministic English-like stories (same text on every machine): a few hundred words in a small grammar,
    with titles, dialogue and sums in words, so a character model's loss falls far below uniform quickly."""
    rng = _SplitMix64(seed)
    parts, size, story = [], 0, 0
    while size < n_chars:
        if story % 6 == 0:
            animal = f"{rng.pick(_ADJECTIVES).capitalize()} {rng.pick(_ANIMALS).capitalize()}"
            parts.append(f"Story {story // 6 + 1}: The {animal}\n\n")
            size += len(parts[-1])
        parts.append(" ".join(_sentence(rng) for _ in range(3 + rng.below(4))) + "\n\n")
        size += len(parts[-1])
        story += 1
    return "".join(parts)[:n_chars]


def load_corpus(path: str | Path | None = None, *, min_chars: int = 1000) -> str:
    """The training text: the built-in generated corpus (path=None) or a local UTF-8 text file (labs' --data).

    Raises FileNotFoundError for a missing file and ValueError for a directory, a non-UTF-8 file, or a text
    shorter than min_chars characters, each saying what to pass instead."""
    if path is None:
        return generate_corpus()
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"corpus file {str(p)!r} does not exist: pass the path of a UTF-8 text file, "
                                f"or no path for the built-in corpus")
    if p.is_dir():
        raise ValueError(f"corpus path {str(p)!r} is a directory: pass the path of one UTF-8 text file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"corpus file {str(p)!r} is not UTF-8 text ({e.reason} at byte {e.start}): "
                         f"convert it to UTF-8 or pick another file") from None
    if not text.strip():
        raise ValueError(f"corpus file {str(p)!r} is empty: pass a file with text in it")
    if len(text) < min_chars:
        raise ValueError(f"corpus file {str(p)!r} has {len(text)} characters, fewer than min_chars={min_chars}: "
                         f"use a longer text (or lower min_chars for a deliberate toy)")
    return text


class CharTokenizer:
    """One token per character. The vocabulary is the sorted set of characters in `text`, so the same text
    always gives the same ids; CharTokenizer(tok.chars) rebuilds a tokenizer from its vocabulary."""

    def __init__(self, text: str):
        if not text:
            raise ValueError("CharTokenizer needs a non-empty text to build its vocabulary from")
        self.chars = "".join(sorted(set(text)))
        self._id = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._id[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in this tokenizer's vocabulary of {self.vocab_size}: "
                             f"build the tokenizer from a text that contains it") from None

    def decode(self, ids) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        bad = [i for i in ids if not (isinstance(i, int) and 0 <= i < self.vocab_size)]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside this tokenizer's vocabulary 0..{self.vocab_size - 1}")
        return "".join(self.chars[i] for i in ids)
