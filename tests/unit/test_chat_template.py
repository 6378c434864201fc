"""The chat template renders as transformers' apply_chat_template renders it: the
pipeline's plain template and a template using what real ones use (tojson, loop
controls, raise_exception, the special tokens), text and token ids alike."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from lmops.pipeline.tokenize_stage import CHAT_TEMPLATE
from lmops.runtime.chat_template import ChatTemplateError, compile_template, render
from lmops.runtime.model_dir import read_chat_template, special_tokens
from lmops.runtime.tokenizer import load_tokenizer
from tests.conftest import make_tiny_model_dir

# Like real instruct templates: special tokens, tojson, loop controls, raise_exception.
RICH = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "{% if loop.index > 8 %}{% break %}{% endif %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] | trim }}{{ eos_token }}\n"
    "{% if m.get('name') %}{{ {'name': m['name'], 'html': '<b>&</b>'} | tojson }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CHATS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "  What is 2 + 2?\n", "name": "ann"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And <s> é 漢字?"},
    ],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("chat-model"))


def test_the_pipeline_writes_its_template(model_dir):
    assert read_chat_template(model_dir) == CHAT_TEMPLATE
    assert json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    text = render(CHAT_TEMPLATE, CHATS[1][:2], special_tokens(model_dir), add_generation_prompt=True)
    assert text == "System: Be brief.\n\nUser: What is 2 + 2?\n\nAssistant:"


@pytest.mark.parametrize("template", [None, RICH], ids=["pipeline", "rich"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CHATS, ids=["one", "many"])
def test_parity_with_transformers(model_dir, template, add_generation_prompt, messages):
    hf = AutoTokenizer.from_pretrained(model_dir)
    source = template or read_chat_template(model_dir)
    kw = {"chat_template": template, "add_generation_prompt": add_generation_prompt}
    want = hf.apply_chat_template(messages, tokenize=False, **kw)
    got = render(source, messages, special_tokens(model_dir), add_generation_prompt)
    assert got == want
    ids = load_tokenizer(model_dir).encode(got, add_special_tokens=False).ids
    assert ids == hf.apply_chat_template(messages, **kw)["input_ids"]


def test_errors_are_chat_template_errors(model_dir):
    with pytest.raises(ChatTemplateError, match="bad role tool"):
        render(RICH, [{"role": "tool", "content": "x"}], special_tokens(model_dir), True)
    with pytest.raises(ChatTemplateError, match="does not parse"):
        compile_template("{% for %}")
    with pytest.raises(ChatTemplateError, match="failed"):  # the sandbox: no attribute escapes
        render("{{ messages.__class__.__mro__ }}", [], {}, True)
