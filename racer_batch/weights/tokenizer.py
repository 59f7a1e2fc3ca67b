"""A stored model's tokenizer over the ``tokenizers`` library alone (issue 31, "Memory").

transformers' ``TokenizersBackend`` wraps the same ``tokenizers.Tokenizer`` that ``tokenizer.json`` describes, but
importing it brings ~30 transformers modules (hub, chat parsing, integrations) and it builds Python-side tables
of its own: together ~36 MB more of a worker's memory than the Rust tokenizer and jinja2 alone (measured on
SmolLM2: 69 MB vs 33 MB). ``PlainTokenizer`` is the part of its interface this product calls: encode
(``__call__``), ``decode``, ``apply_chat_template`` for ``{"role", "content"}`` messages, the special tokens,
``convert_tokens_to_ids`` and ``get_vocab``; each gives what ``AutoTokenizer`` gives on the same folder
(tests/integration/test_stored_model.py holds them equal on the smoke prompts, chats and decodes).

Only a simple folder gets one (``plain_tokenizer_blocker`` says why not): a ``tokenizer.json`` whose
post-processor and decoder are used as saved, and a ``tokenizer_config.json`` with none of the settings
``TokenizersBackend`` applies on top of the file (BOS/EOS insertion, prefix spaces, clean-up of spaces, extra
special tokens). Any other folder keeps transformers' class.

The chat template is rendered the way transformers 5 renders it (``utils/chat_template_utils.py``): a jinja2
sandbox with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, ``raise_exception``,
``strftime_now``, a ``tojson`` filter that does not escape HTML, ``dict`` and an underscore-refusing
``namespace``; the template sees ``messages``, ``tools=None``, ``documents=None``, ``add_generation_prompt`` and
the special tokens by name (``bos_token``, ...); a message's reasoning under any of its three names is shown
under all of them.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

# tokenizer_config.json keys that change nothing TokenizersBackend does with tokenizer.json (names, paths,
# lengths, the special tokens' names, the chat template); any other key refuses the plain tokenizer.
_PLAIN_CONFIG_KEYS = frozenset({
    "backend", "tokenizer_class", "is_local", "local_files_only", "model_max_length", "name_or_path",
    "bos_token", "eos_token", "unk_token", "pad_token", "chat_template", "model_input_names", "padding_side",
    "truncation_side", "clean_up_tokenization_spaces",
})
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# apply_chat_template arguments of transformers' that change the rendering and that PlainTokenizer refuses
# rather than ignores (a falsy value is accepted: it asks for nothing)
_UNSUPPORTED_CHAT_ARGS = ("tools", "documents", "continue_final_message", "chat_template",
                          "return_assistant_tokens_mask", "return_tensors", "padding", "truncation", "max_length")


def plain_tokenizer_blocker(folder: Any) -> Optional[str]:
    """Why ``folder``'s tokenizer must load through transformers, or None when ``PlainTokenizer`` gives the same.

    Refused: no ``tokenizer.json`` or ``tokenizer_config.json``; a class other than ``TokenizersBackend``; a
    config key outside the plain set (``add_bos_token``, ``add_prefix_space``, extra special tokens, ...); spaces
    cleaned up on decode; a special token given as anything but a string present in the vocabulary.
    """
    folder = Path(folder)
    try:
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError) as e:
        return f"tokenizer_config.json unreadable ({e})"
    if not (folder / "tokenizer.json").is_file():
        return "no tokenizer.json"
    if cfg.get("tokenizer_class") != "TokenizersBackend":
        return f"tokenizer class {cfg.get('tokenizer_class')!r}"
    extra = sorted(set(cfg) - _PLAIN_CONFIG_KEYS)
    if extra:
        return f"tokenizer settings {extra}"
    if cfg.get("clean_up_tokenization_spaces"):
        return "clean_up_tokenization_spaces"
    for name in _SPECIAL_NAMES:
        if name in cfg and cfg[name] is not None and not isinstance(cfg[name], str):
            return f"{name} is not a plain string"
    return None


class PlainTokenizer:
    """``tokenizer.json`` through ``tokenizers.Tokenizer`` plus the folder's chat template.

    Attributes:
        chat_template: the template text (``chat_template.jinja``, else the config's), or None.
        bos_token, eos_token, unk_token, pad_token: the special tokens' texts from the config, or None.
        eos_token_id, bos_token_id, unk_token_id, pad_token_id: their ids (None without one).
    """

    def __init__(self, folder: Any) -> None:
        """Raises: ValueError (``plain_tokenizer_blocker`` names the reason), OSError (files unreadable)."""
        import tokenizers

        folder = Path(folder)
        why = plain_tokenizer_blocker(folder)
        if why is not None:
            raise ValueError(f"{folder}: not a plain tokenizer: {why}")
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        self._tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        self._tok.no_truncation()
        self._tok.no_padding()
        template = folder / "chat_template.jinja"
        self.chat_template: Optional[str] = template.read_text() if template.is_file() else cfg.get("chat_template")
        self._specials = {n: cfg[n] for n in _SPECIAL_NAMES if cfg.get(n) is not None}
        for name in _SPECIAL_NAMES:  # bos_token / bos_token_id, ... (None without one)
            text = self._specials.get(name)
            tid = None if text is None else self._tok.token_to_id(text)
            if text is not None and tid is None:
                raise ValueError(f"{folder}: {name} {text!r} is not in the vocabulary")
            setattr(self, name, text)
            setattr(self, f"{name}_id", tid)
        self._compiled: Any = None

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The special tokens by name, as the chat template sees them."""
        return dict(self._specials)

    @property
    def all_special_tokens(self) -> list[str]:
        """The distinct special tokens' texts in the order bos, eos, unk, pad."""
        return list(dict.fromkeys(self._specials.values()))

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        """``{"input_ids": [...], "attention_mask": [1, ...]}`` of one text (the saved post-processor applies
        when ``add_special_tokens``). Raises TypeError for anything but a str."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self(text, add_special_tokens=add_special_tokens)["input_ids"]

    def decode(self, token_ids: Any, skip_special_tokens: bool = False) -> str:
        """Text of ``token_ids`` (an int, a list of ints, or a mapping with ``input_ids``); with
        ``skip_special_tokens`` the added tokens marked special are left out."""
        if hasattr(token_ids, "keys"):
            token_ids = token_ids["input_ids"]
        if hasattr(token_ids, "tolist"):
            token_ids = token_ids.tolist()
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        return self._tok.decode([int(t) for t in token_ids], skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: Any, skip_special_tokens: bool = False) -> list[str]:
        """``decode`` of each sequence."""
        return [self.decode(s, skip_special_tokens=skip_special_tokens) for s in sequences]

    def convert_ids_to_tokens(self, ids: Any) -> Any:
        """Token text of an id (None when outside the vocabulary), or a list of them for a list."""
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        return [self._tok.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: Any) -> Any:
        """Id of a token text (None when unknown and no ``unk_token``), or a list of them for a list."""
        if isinstance(tokens, str):
            tid = self._tok.token_to_id(tokens)
            return tid if tid is not None or self.unk_token is None else self._tok.token_to_id(self.unk_token)
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        """Every token text (added tokens included) to its id."""
        return self._tok.get_vocab(with_added_tokens=True)

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = True, **kwargs: Any) -> Any:
        """The chat rendered by the template: its text when not ``tokenize``; else ``{"input_ids",
        "attention_mask"}`` (the ids alone when not ``return_dict``), encoded without added special tokens.
        Extra keyword arguments reach the template as variables (over the special tokens of the same name).

        Raises:
            ValueError: no chat template, or a message that is not a mapping of JSON values.
            jinja2.exceptions.TemplateError: the template raised (``raise_exception``) or is malformed.
        """
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        unsupported = sorted(k for k in _UNSUPPORTED_CHAT_ARGS if kwargs.get(k) not in (None, False))
        if unsupported:
            raise ValueError(f"{unsupported} not supported by PlainTokenizer.apply_chat_template (the product's "
                             "chat rows do not use them); load the folder with transformers' AutoTokenizer for them")
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise ValueError("a chat is a non-empty list of messages (one conversation; batches are not supported)")
        messages = [_template_message(i, m) for i, m in enumerate(conversation)]
        variables = {**self._specials, **{k: v for k, v in kwargs.items() if k not in _UNSUPPORTED_CHAT_ARGS}}
        text = self._template().render(messages=messages, tools=None, documents=None,
                                       add_generation_prompt=add_generation_prompt, **variables)
        if not tokenize:
            return text
        out = self(text, add_special_tokens=False)
        return out if return_dict else out["input_ids"]

    def _template(self) -> Any:
        if self._compiled is None:
            self._compiled = compile_chat_template(self.chat_template)
        return self._compiled


def _json_value(value: Any, where: str) -> Any:
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {str(k): _json_value(v, where) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v, where) for v in value]
    raise ValueError(f"{where} holds a {type(value).__name__}; chat messages hold JSON values only")


def _template_message(i: int, message: Any) -> dict[str, Any]:
    """A fresh plain copy of message ``i``, its reasoning (if any) under each of its names."""
    if not isinstance(message, dict):
        raise ValueError(f"message {i} must be a mapping, got {type(message).__name__}")
    out = {k: v for k, v in _json_value(message, f"message {i}").items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_FIELDS if out.get(k) is not None), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def compile_chat_template(source: str) -> Any:
    """A jinja2 template in the sandbox chat templates run in (see the module docstring). Raises
    jinja2.exceptions.TemplateSyntaxError for a malformed template."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # self among args: a namespace may hold "self"
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace.check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")

    class Dict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, dict=Dict(), namespace=Namespace,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(source)
