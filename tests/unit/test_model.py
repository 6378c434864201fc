import json

import pytest
import torch

from lmops.errors import LmopsError
from lmops.runtime.model import KVCache, Llama
from lmops.runtime.model_config import LlamaConfig

CFG = LlamaConfig(
    vocab_size=320, n_layer=2, n_head=4, n_kv_heads=2, n_embd=64, intermediate_size=160, max_seq_len=64
)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Llama(CFG).eval()


@pytest.mark.parametrize(
    ("tie", "qk_norm", "hf_class"),
    [(True, False, "LlamaForCausalLM"), (False, False, "LlamaForCausalLM"), (True, True, "Qwen3ForCausalLM")],
)
def test_transformers_loads_our_directory_and_logits_match(tmp_path, tie, qk_norm, hf_class):
    """Stock classes through AutoModelForCausalLM: Llama's layout, and with QK-norm Qwen3's,
    whose q_norm and k_norm get weights of their own (not 1) so that mixing them up shows."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    ours = Llama(LlamaConfig(**{**CFG.__dict__, "tie_embeddings": tie, "qk_norm": qk_norm})).eval()
    with torch.no_grad():
        for layer in ours.model.layers if qk_norm else []:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    ours.save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == hf_class
    assert hf.config.num_key_value_heads == 2 < hf.config.num_attention_heads  # GQA on
    x = torch.randint(0, CFG.vocab_size, (3, 50))
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[0], hf(x).logits, atol=1e-4, rtol=0)
        if qk_norm:  # the norms matter: without them the logits are not these
            for layer in hf.model.layers:
                layer.self_attn.k_norm.weight.fill_(1.0)
            assert not torch.allclose(ours(x)[0], hf(x).logits, atol=1e-3, rtol=0)


def test_kv_cache_decoding_equals_full_forward(model):
    x = torch.randint(0, CFG.vocab_size, (2, 40))
    with torch.no_grad():
        full, _ = model(x)
        cache = KVCache(CFG, 2, CFG.max_seq_len, "cpu", torch.float32)
        steps = [model(x[:, :25], positions=torch.arange(25).expand(2, 25), cache=cache)[0]]
        for t in range(25, 40):
            steps.append(model(x[:, t : t + 1], positions=torch.full((2, 1), t), cache=cache)[0])
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=0)


def test_loss_is_cross_entropy(model):
    x = torch.randint(0, CFG.vocab_size, (2, 16))
    logits, loss = model(x, x)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, CFG.vocab_size), x.reshape(-1))
    assert torch.allclose(loss, ref)


def test_round_trip_and_bad_directories(model, tmp_path):
    model.save_pretrained(tmp_path)
    again = Llama.from_pretrained(tmp_path)
    x = torch.randint(0, CFG.vocab_size, (1, 8))
    with torch.no_grad():
        assert torch.equal(model(x)[0], again(x)[0])

    weights = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    with pytest.raises(LmopsError, match="corrupt weights file"):
        Llama.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(weights)

    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": 32}))
    with pytest.raises(LmopsError, match="do not match config.json"):
        Llama.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_attention_heads": 5}))
    with pytest.raises(
        LmopsError, match=r"invalid model config \(n_embd \(64\) must be divisible by n_head \(5\)\)"
    ):
        Llama.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    with pytest.raises(LmopsError, match="model_type 'mistral' is not one lmops runs \\(llama or qwen3\\)"):
        Llama.from_pretrained(tmp_path)
    other = {"qwen3": "llama", "llama": "qwen3"}[config["model_type"]]  # weights with or without q_norm
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": other}))
    with pytest.raises(LmopsError, match="do not match config.json.*q_norm"):
        Llama.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(LmopsError, match="unreadable model config"):
        Llama.from_pretrained(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(LmopsError, match="missing config.json"):
        Llama.from_pretrained(tmp_path)
