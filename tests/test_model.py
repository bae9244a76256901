"""The tiny GPT: shapes, a sane initial loss, learning on the built-in corpus, bf16, seeded init and sampling."""
import math

import pytest
import torch

from nanodist.data import CharTokenizer, TokenStream, load_corpus
from nanodist.model import GPT, PRESETS, GPTConfig


def tiny(vocab_size=65, **kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", vocab_size=vocab_size, **kw))


def test_shapes_and_initial_loss_is_uniform():
    model = tiny()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 65, (4, 64), generator=g)
    y = torch.randint(0, 65, (4, 64), generator=g)
    logits, loss = model(x, y)
    assert logits.shape == (4, 64, 65)
    # Small init: every token about equally likely, so cross-entropy is close to ln(vocab).
    assert abs(loss.item() - math.log(65)) < 0.1
    logits, loss = model(x[:, :10])
    assert logits.shape == (4, 10, 65) and loss is None
    with pytest.raises(ValueError, match="exceeds block_size=64"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_ignore_index_and_untied_head():
    model = tiny(tie_weights=False, bias=False)
    assert model.lm_head.weight is not model.wte.weight
    assert not any(n.endswith("bias") for n, _ in model.named_parameters())
    x = torch.zeros(2, 8, dtype=torch.long)
    y = torch.full((2, 8), -1)
    y[0, 0] = 3
    _, loss = model(x, y)
    logits, _ = model(x)
    assert torch.allclose(loss, torch.nn.functional.cross_entropy(logits[0, :1], y[0, :1]))


def test_config_errors_and_presets():
    with pytest.raises(ValueError, match="n_embd=65 must be divisible by n_head=4"):
        GPTConfig(n_embd=65, n_head=4)
    with pytest.raises(ValueError, match="unknown GPT preset 'huge'"):
        GPTConfig.preset("huge")
    with pytest.raises(ValueError, match="vocab_size"):
        GPTConfig(vocab_size=0)
    for name in PRESETS:
        cfg = GPTConfig.preset(name, vocab_size=50)
        assert GPTConfig(**cfg.to_dict()) == cfg


def test_param_groups_cover_every_parameter_once():
    model = tiny()
    decay, no_decay = model.configure_param_groups(weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    ids = [id(p) for p in decay["params"] + no_decay["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))  # the tied weight appears once
    assert sum(p.numel() for p in decay["params"] + no_decay["params"]) == model.num_params()
    assert "wte.weight" in decay["param_names"] and "ln_f.weight" in no_decay["param_names"]
    assert model.num_params(exclude_embeddings=True) == model.num_params() - 64 * 64  # wpe only: wte is tied
    opt = torch.optim.AdamW(model.configure_param_groups(0.1), lr=1e-3)  # torch accepts the groups as they are
    assert len(opt.param_groups) == 2


def test_init_is_deterministic_from_the_global_seed():
    a, b = tiny().state_dict(), tiny().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    torch.manual_seed(1)
    c = GPT(GPTConfig.preset("tiny", vocab_size=65)).state_dict()
    assert not torch.equal(a["blocks.0.attn.qkv.weight"], c["blocks.0.attn.qkv.weight"])


def test_loss_falls_on_the_builtin_corpus():
    text = load_corpus()
    tok = CharTokenizer(text)
    model = tiny(tok.vocab_size)
    stream = TokenStream(torch.tensor(tok.encode(text)), batch_size=8, block_size=64, rank=0, world_size=1)
    opt = torch.optim.AdamW(model.configure_param_groups(0.1), lr=5e-3)
    losses = []
    for _ in range(60):
        x, y = next(stream)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    uniform = math.log(tok.vocab_size)
    assert abs(losses[0] - uniform) < 0.15
    assert sum(losses[-5:]) / 5 < uniform - 1.2, losses  # 4.17 -> about 2.4 in 60 steps


def test_bf16_autocast_forward_and_backward():
    model = tiny()
    x = torch.randint(0, 65, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = model(x, x)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_generate_is_reproducible_and_leaves_global_rng_alone():
    model = tiny()
    model.train()
    prompt = torch.zeros(2, 60, dtype=torch.long)  # 60 + 10 > block_size: the context is cropped
    before = torch.get_rng_state()
    a = model.generate(prompt, 10, generator=torch.Generator().manual_seed(3), top_k=20)
    b = model.generate(prompt, 10, generator=torch.Generator().manual_seed(3), top_k=20)
    c = model.generate(prompt, 10, generator=torch.Generator().manual_seed(4), top_k=20)
    assert torch.equal(torch.get_rng_state(), before)
    assert a.shape == (2, 70) and torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a[:, :60], prompt) and model.training  # mode restored
    greedy = model.generate(prompt[:, :5], 3, temperature=0)
    assert torch.equal(greedy, model.generate(prompt[:, :5], 3, temperature=0))
    with pytest.raises(ValueError, match="explicit generator"):
        model.generate(prompt, 1)



def test_a_model_built_on_the_meta_device_initialises_every_parameter():
    """init_weights() after to_empty() sets every parameter, LayerNorms included (to_empty leaves whatever the
    memory held): from the same generator state it gives exactly what it gives a model built on the CPU."""
    cfg = GPTConfig.preset("tiny", vocab_size=40)
    torch.manual_seed(0)
    built = GPT(cfg)
    with torch.device("meta"):
        meta = GPT(cfg)
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    assert meta.lm_head.weight is not meta.wte.weight  # torch's to_empty unties them; init_weights ties them again
    with torch.no_grad():
        for p in meta.parameters():
            p.fill_(7.0)  # what the memory might hold
    for model in (built, meta):
        torch.manual_seed(3)
        model.init_weights()
    for (name, a), b in zip(built.named_parameters(), meta.parameters()):
        assert torch.equal(a, b), name
    for module in meta.modules():
        if isinstance(module, torch.nn.LayerNorm):
            assert torch.equal(module.weight, torch.ones_like(module.weight))
    assert meta.lm_head.weight is meta.wte.weight  # tied weights survive to_empty
