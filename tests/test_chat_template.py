"""Chat templates render exactly as transformers renders them."""
import json

import pytest

from colibri_core.chat_template import ChatTemplate
from colibri_core.errors import ColibriError

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' and not loop.first %}{{ raise_exception('system must come first') }}{% endif %}"
    "{% if m['content'] == 'skip' %}{% continue %}{% endif %}"
    "<|{{ m['role'] }}|>\n  {{ m['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be <brief> & kind"}, {"role": "user", "content": " héllo "},
            {"role": "user", "content": "skip"}]
TOOLS = [{"type": "function", "function": {"name": "f", "description": "a <b> & 'c'"}}]


@pytest.fixture
def model_dir(tiny_checkpoint, tmp_path):
    cfg = json.loads((tiny_checkpoint / "tokenizer_config.json").read_text())
    cfg.update(chat_template=TEMPLATE, bos_token="<|system|>")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "tokenizer.json").write_text((tiny_checkpoint / "tokenizer.json").read_text())
    return tmp_path


def test_matches_transformers(model_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_dir)
    ours = ChatTemplate.from_dir(model_dir)
    for gen in (True, False):
        for tools in (None, TOOLS):
            want = hf.apply_chat_template(MESSAGES, tools=tools, add_generation_prompt=gen, tokenize=False)
            assert ours.render(MESSAGES, add_generation_prompt=gen, tools=tools) == want


def test_raise_exception_is_one_line_error(model_dir):
    with pytest.raises(ColibriError, match="system must come first"):
        ChatTemplate.from_dir(model_dir).render([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])


def test_jinja_file_wins(model_dir):
    (model_dir / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert ChatTemplate.from_dir(model_dir).render([{"role": "user", "content": "x"}]) == "x"


def test_no_template(tmp_path):
    assert ChatTemplate.from_dir(tmp_path) is None
