"""weights/tokenizer.py: the tokenizer over the ``tokenizers`` library alone, held to transformers'
``AutoTokenizer`` on a small saved folder (chat-template features: namespaces, loop controls, ``tojson``,
``raise_exception``, reasoning fields) and refused where transformers would apply settings of its own."""

from __future__ import annotations

import json

import jinja2
import pytest

from racer_batch.weights.tokenizer import PlainTokenizer, plain_tokenizer_blocker

WORDS = ["hello", "world", "a", "b", "c", "user", "assistant", "system", "think", ":", "{", "}", "\n", "x"]
SPECIALS = ["<unk>", "<s>", "</s>", "<tool>"]
TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(n=0) %}"
    "{% for m in messages %}{% if m['role'] == 'skip' %}{% continue %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}{{ m['role'] }}: {{ m['content'] }}"
    "{% if m.get('reasoning_content') %} think {{ m['reasoning_content'] }} {{ m['thinking'] }}{% endif %}"
    "{% if m.get('meta') %} {{ m['meta'] | tojson }}{% endif %}{{ eos_token }}\n"
    "{% if m['role'] == 'boom' %}{{ raise_exception('no boom here') }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}{{ ns.n }}{{ dict(a=1)['a'] }}"
)


def make_folder(tmp_path, **config):
    """A saved tokenizer folder: a word-level tokenizer.json with four special tokens and a config naming
    ``TokenizersBackend``; ``config`` entries overwrite or add config keys."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = {"tokenizer_class": "TokenizersBackend", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
           "chat_template": TEMPLATE, **config}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return tmp_path


CHATS = [
    [{"role": "user", "content": "hello world"}],
    [{"role": "system", "content": "a b"}, {"role": "skip", "content": "x"}, {"role": "user", "content": "c"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning": "c c"}],
    [{"role": "user", "content": "a", "meta": {"k": [1, 2.5, None, "é<>"]}}],
]


def test_encodes_renders_and_decodes_as_auto_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    folder = make_folder(tmp_path)
    ours, auto = PlainTokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert type(auto).__name__ == "TokenizersBackend"
    assert ours.special_tokens_map == auto.special_tokens_map and ours.all_special_tokens == auto.all_special_tokens
    assert ours.eos_token_id == auto.eos_token_id == SPECIALS.index("</s>")
    assert ours.get_vocab() == auto.get_vocab()
    assert ours.convert_tokens_to_ids(["hello", "nope"]) == auto.convert_tokens_to_ids(["hello", "nope"])
    for text in ("hello world", "a <tool> b </s>", "nope x", ""):
        assert ours(text)["input_ids"] == auto(text)["input_ids"]
        assert ours.encode(text, add_special_tokens=False) == auto.encode(text, add_special_tokens=False)
    for chat in CHATS:
        for gen in (True, False):
            text = ours.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            assert text == auto.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            ids = ours.apply_chat_template(chat, add_generation_prompt=gen)
            assert ids == dict(auto.apply_chat_template(chat, add_generation_prompt=gen))
            assert ours.apply_chat_template(chat, return_dict=False) == \
                auto.apply_chat_template(chat, return_dict=False)
            for skip in (True, False):
                assert ours.decode(ids["input_ids"], skip_special_tokens=skip) == \
                    auto.decode(ids["input_ids"], skip_special_tokens=skip)
    assert "think c c c c" in ours.apply_chat_template(CHATS[2], tokenize=False)  # reasoning under both names
    assert ours.decode(5) == auto.decode(5) and ours.decode({"input_ids": [4, 5]}) == auto.decode([4, 5])
    import torch

    assert ours.decode(torch.tensor(5)) == auto.decode(torch.tensor(5))
    assert ours.decode(torch.tensor([4, 5])) == auto.decode(torch.tensor([4, 5]))
    assert ours.batch_decode([[4, 5], [6]]) == auto.batch_decode([[4, 5], [6]])
    assert ours.convert_ids_to_tokens([4, 5]) == auto.convert_ids_to_tokens([4, 5])
    assert ours.convert_ids_to_tokens(2) == auto.convert_ids_to_tokens(2)
    for name in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id"):
        assert getattr(ours, name) == getattr(auto, name), name


def test_template_errors_and_the_sandbox(tmp_path):
    ours = PlainTokenizer(make_folder(tmp_path))
    with pytest.raises(jinja2.exceptions.TemplateError, match="no boom here"):
        ours.apply_chat_template([{"role": "boom", "content": "a"}])
    with pytest.raises(ValueError, match="message 1 must be a mapping"):
        ours.apply_chat_template([{"role": "user", "content": "a"}, "hello"])
    with pytest.raises(ValueError, match="JSON values only"):
        ours.apply_chat_template([{"role": "user", "content": "a", "meta": object()}])
    with pytest.raises(TypeError, match="must be a str"):
        ours(["hello"])
    for kwargs in ({"tools": [{"name": "f"}]}, {"continue_final_message": True}, {"documents": [{"text": "a"}]}):
        with pytest.raises(ValueError, match="not supported by PlainTokenizer"):  # refused, never ignored
            ours.apply_chat_template(CHATS[0], tokenize=False, **kwargs)
    assert ours.apply_chat_template(CHATS[0], tokenize=False, tools=None) == \
        ours.apply_chat_template(CHATS[0], tokenize=False)
    for bad in ([], [CHATS[0], CHATS[1]]):
        with pytest.raises(ValueError):
            ours.apply_chat_template(bad)
    bad = PlainTokenizer(make_folder(tmp_path, chat_template="{% set ns = namespace(_x=1) %}{{ ns._x }}"))
    with pytest.raises(jinja2.exceptions.SecurityError):
        bad.apply_chat_template(CHATS[0], tokenize=False)
    none = PlainTokenizer(make_folder(tmp_path, chat_template=None))
    assert none.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        none.apply_chat_template(CHATS[0])


def test_a_chat_template_file_wins_over_the_config(tmp_path):
    folder = make_folder(tmp_path)
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert PlainTokenizer(folder).apply_chat_template(CHATS[0], tokenize=False) == "hello world!"


@pytest.mark.parametrize("config,why", [
    ({"add_bos_token": True}, "tokenizer settings ['add_bos_token']"),
    ({"add_prefix_space": True, "extra_special_tokens": ["x"]}, "tokenizer settings ['add_prefix_space', 'extra"),
    ({"tokenizer_class": "LlamaTokenizer"}, "tokenizer class 'LlamaTokenizer'"),
    ({"clean_up_tokenization_spaces": True}, "clean_up_tokenization_spaces"),
    ({"eos_token": {"content": "</s>", "special": True}}, "eos_token is not a plain string"),
])
def test_folders_transformers_would_change_are_refused(tmp_path, config, why):
    folder = make_folder(tmp_path, **config)
    assert why in plain_tokenizer_blocker(folder)
    with pytest.raises(ValueError, match="not a plain tokenizer"):
        PlainTokenizer(folder)


def test_missing_files_and_unknown_special_tokens_are_refused(tmp_path):
    assert "tokenizer_config.json unreadable" in plain_tokenizer_blocker(tmp_path)
    folder = make_folder(tmp_path, eos_token="<eot>")
    with pytest.raises(ValueError, match="eos_token '<eot>' is not in the vocabulary"):
        PlainTokenizer(folder)
    (folder / "tokenizer.json").unlink()
    assert plain_tokenizer_blocker(folder) == "no tokenizer.json"


def test_the_loader_falls_back_to_transformers_for_a_refused_folder(tmp_path):
    from racer_batch.weights.plain import load_tokenizer

    assert isinstance(load_tokenizer(make_folder(tmp_path)), PlainTokenizer)
    other = load_tokenizer(make_folder(tmp_path, add_bos_token=False))
    assert type(other).__name__ == "TokenizersBackend"
