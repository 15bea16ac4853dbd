"""Text <-> token ids, chat templates and streaming detokenization.

One `Tokenizer` class over the `tokenizers` library, built either from a Hugging Face model
directory (tokenizer.json + tokenizer_config.json + generation_config.json) or from a GGUF
file's tokenizer metadata (byte-level BPE or sentencepiece-style vocabularies)."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Sequence

from .errors import CheckpointError, KogError


class ChatTemplateError(KogError):
    """A chat template that does not compile, or that rejects the given messages."""


# GGUF tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED, _TOKEN_UNUSED, _TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Split regexes of the Hugging Face tokenizer.json files these GGUF `tokenizer.ggml.pre` names stand for.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_PRE = {"llama-bpe", "llama3", "llama-v3", "dbrx", "smaug-bpe"}
_QWEN2_PRE = {"qwen2", "deepseek-r1-qwen"}


class Tokenizer:
    """Encode/decode, chat templates and a streaming decoder for one model."""

    def __init__(self, backend, *, bos_token: str | None = None, eos_tokens: Sequence[str] = (),
                 bos_token_id: int | None = None, eos_token_ids: Sequence[int] = (),
                 chat_template: str | None = None, special_tokens: Mapping[str, str] | None = None):
        self._tok = backend  # a tokenizers.Tokenizer (or an object with the same few methods)
        self.bos_token_id = bos_token_id if bos_token_id is not None else _token_id(backend, bos_token)
        self.bos_token = bos_token if bos_token is not None else _token_str(backend, self.bos_token_id)
        ids = set(int(i) for i in eos_token_ids)
        ids.update(i for i in (_token_id(backend, t) for t in eos_tokens) if i is not None)
        self.eos_token_ids: frozenset[int] = frozenset(ids)
        self.eos_token = (eos_tokens[0] if eos_tokens else
                          _token_str(backend, min(self.eos_token_ids)) if self.eos_token_ids else None)
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})  # extra template variables (unk_token, pad_token)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of text; special tokens written in the text (e.g. "<|im_start|>") map to their ids."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    # ------------------------------------------------------------------ chat

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        """Render messages with the model's chat template, as transformers does."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; pass a plain prompt instead of chat messages")
        import jinja2
        template = _compile_template(self.chat_template)
        variables = {**self.special_tokens, "bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   **variables, **extra)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the model's chat template rejected the messages: {e}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Prompt ids for chat messages: the rendered template, without a doubled BOS."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        ids = self.encode(text, add_special_tokens=True)
        bos = self.bos_token_id
        if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]  # the template already wrote BOS and the tokenizer added another
        return ids

    # ------------------------------------------------------------------ streaming

    def stream_decoder(self, skip_special_tokens: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_hf_dir(cls, path: str | Path, config: Mapping[str, Any] | None = None) -> "Tokenizer":
        """The tokenizer of a Hugging Face model directory; CheckpointError if it has none usable."""
        directory = Path(path)
        tok_config = _read_json(directory / "tokenizer_config.json")
        gen_config = _read_json(directory / "generation_config.json")
        config = dict(config if config is not None else _read_json(directory / "config.json"))

        if (directory / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as HFTokenizer
            try:
                backend = HFTokenizer.from_file(str(directory / "tokenizer.json"))
            except Exception as e:  # the tokenizers library raises a bare Exception on bad JSON
                raise CheckpointError(f"{directory / 'tokenizer.json'} cannot be loaded ({e}); re-download it") \
                    from None
        elif (directory / "tokenizer.model").is_file():
            backend = _SentencePieceBackend.load(directory / "tokenizer.model", tok_config)
        else:
            raise CheckpointError(f"{directory} has no tokenizer.json or tokenizer.model")

        bos_token = _token_content(tok_config.get("bos_token"))
        eos_tokens = [t for t in [_token_content(tok_config.get("eos_token"))] if t]
        eos_ids = _as_id_list(gen_config.get("eos_token_id")) or _as_id_list(config.get("eos_token_id"))
        bos_id = _token_id(backend, bos_token)
        if bos_id is None:
            bos_id = gen_config.get("bos_token_id", config.get("bos_token_id"))
        special = {k: _token_content(tok_config.get(k)) or "" for k in ("unk_token", "pad_token")}
        return cls(backend, bos_token=bos_token, eos_tokens=eos_tokens, bos_token_id=bos_id,
                   eos_token_ids=eos_ids, chat_template=_hf_chat_template(directory, tok_config),
                   special_tokens=special)

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> "Tokenizer":
        """The tokenizer described by a GGUF file's `tokenizer.*` metadata (see gguf_loader.metadata)."""
        model = meta.get("tokenizer.ggml.model")
        tokens = list(meta.get("tokenizer.ggml.tokens") or [])
        if not tokens:
            raise CheckpointError("the GGUF file has no tokenizer.ggml.tokens; it carries no tokenizer")
        types = list(meta.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens))
        if model == "gpt2":
            backend = _gguf_byte_level_bpe(tokens, list(meta.get("tokenizer.ggml.merges") or []),
                                           meta.get("tokenizer.ggml.pre") or "default")
            add_bos_default = False
        elif model == "llama":
            backend = _gguf_sentencepiece_bpe(tokens, list(meta.get("tokenizer.ggml.scores") or []), types,
                                              bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
            add_bos_default = True
        else:
            raise CheckpointError(f"GGUF tokenizer model {model!r} is not supported (supported: gpt2, llama)")
        _add_gguf_special_tokens(backend, tokens, types)

        def token_id(key):
            value = meta.get(key)
            return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

        bos_id = token_id("tokenizer.ggml.bos_token_id")
        eos_ids = [i for i in (token_id(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                                      "tokenizer.ggml.eom_token_id")) if i is not None]
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        _set_special_token_template(backend, tokens[bos_id] if add_bos and bos_id is not None else None,
                                    tokens[eos_ids[0]] if add_eos and eos_ids else None)
        unk_id, pad_id = token_id("tokenizer.ggml.unknown_token_id"), token_id("tokenizer.ggml.padding_token_id")
        special = {"unk_token": tokens[unk_id] if unk_id is not None else "",
                   "pad_token": tokens[pad_id] if pad_id is not None else ""}
        return cls(backend, bos_token_id=bos_id, eos_token_ids=eos_ids,
                   eos_tokens=[], chat_template=meta.get("tokenizer.chat_template"), special_tokens=special)


class StreamDecoder:
    """Turns generated ids into text deltas as they arrive.

    A character may span several tokens (byte-level BPE splits UTF-8 sequences), and some
    tokenizers change how a token reads depending on its left neighbour (sentencepiece's
    leading space), so we decode a short window and emit only the text that became final."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the window we decode for context
        self._read = 0    # ids before this were already emitted

    def push(self, token_id: int) -> str:
        """The new text this token completes ("" while a character is still incomplete)."""
        self._ids.append(int(token_id))
        decode = self._tokenizer.decode
        emitted = decode(self._ids[self._prefix:self._read], self._skip)
        full = decode(self._ids[self._prefix:], self._skip)
        if len(full) > len(emitted) and not full.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return full[len(emitted):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character comes out as U+FFFD)."""
        decode = self._tokenizer.decode
        emitted = decode(self._ids[self._prefix:self._read], self._skip)
        full = decode(self._ids[self._prefix:], self._skip)
        self._prefix = self._read = len(self._ids)
        return full[len(emitted):] if len(full) > len(emitted) else ""


# ----------------------------------------------------------------------------- chat templates

def _compile_template(source: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """transformers' {% generation %} ... {% endgeneration %} marker: rendered as its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

        def _render_body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the model's chat template does not compile (line {e.lineno}: {e.message})") \
            from None


def _hf_chat_template(directory: Path, tok_config: Mapping[str, Any]) -> str | None:
    """chat_template from tokenizer_config.json, or the newer chat_template.jinja/.json files."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = tok_config.get("chat_template") or _read_json(directory / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


# ----------------------------------------------------------------------------- GGUF vocabularies

def _gguf_byte_level_bpe(tokens: list[str], merges: list[str], pre: str):
    """A GPT-2 style byte-level BPE tokenizer, the pre-tokenizer chosen by `tokenizer.ggml.pre`."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = HFTokenizer(models.BPE(vocab, pairs, ignore_merges=pre in _LLAMA3_PRE))
    if pre == "smollm":
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif pre in _LLAMA3_PRE or pre in _QWEN2_PRE:
        split = _LLAMA3_SPLIT if pre in _LLAMA3_PRE else _QWEN2_SPLIT
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        if pre in _QWEN2_PRE:
            backend.normalizer = normalizers.NFC()
    else:  # "default", "gpt2" and anything else: GPT-2's own split
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend


def _gguf_sentencepiece_bpe(tokens: list[str], scores: list[float], types: list[int], add_space_prefix: bool):
    """A sentencepiece-BPE tokenizer from a GGUF vocabulary with scores.

    SentencePiece BPE merges the adjacent pair whose merged piece scores highest, so merges
    ranked by the merged piece's score reproduce it (as transformers' GGUF converter does)."""
    from tokenizers import decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    if len(scores) != len(tokens):
        raise CheckpointError("the GGUF sentencepiece vocabulary has no tokenizer.ggml.scores; cannot build it")
    vocab = {token: i for i, token in enumerate(tokens)}
    mergeable = [(token, scores[i]) for i, token in enumerate(tokens)
                 if types[i] in (_TOKEN_NORMAL, _TOKEN_USER_DEFINED, _TOKEN_UNUSED) and len(token) > 1]
    ranked = []
    for merged, score in mergeable:
        local = [(merged[:k], merged[k:]) for k in range(1, len(merged))
                 if merged[:k] in vocab and merged[k:] in vocab]
        local.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        ranked.extend((score, pair) for pair in local)
    ranked.sort(key=lambda item: -item[0])  # stable: ties keep vocabulary order
    unk = next((tokens[i] for i, t in enumerate(types) if t == _TOKEN_UNKNOWN), None)
    backend = HFTokenizer(models.BPE(vocab, [pair for _, pair in ranked], unk_token=unk,
                                     fuse_unk=True, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581",
                                                     prepend_scheme="first" if add_space_prefix else "never",
                                                     split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _add_gguf_special_tokens(backend, tokens: list[str], types: list[int]) -> None:
    """Control tokens become special (one id, dropped by skip_special_tokens); user-defined
    tokens are matched whole but kept in decoded text."""
    from tokenizers import AddedToken
    control = [AddedToken(tokens[i], special=True, normalized=False)
               for i, t in enumerate(types) if t == _TOKEN_CONTROL]
    user = [AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types) if t == _TOKEN_USER_DEFINED]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)


def _set_special_token_template(backend, bos: str | None, eos: str | None) -> None:
    """What encode(..., add_special_tokens=True) adds: BOS and/or EOS as the GGUF asks."""
    if bos is None and eos is None:
        return
    from tokenizers import processors
    single = " ".join(p for p in (f"{bos}:0" if bos else None, "$A:0", f"{eos}:0" if eos else None) if p)
    pair = " ".join(p for p in (single, f"{bos}:1" if bos else None, "$B:1", f"{eos}:1" if eos else None) if p)
    specials = [(t, backend.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


# ----------------------------------------------------------------------------- sentencepiece fallback

class _SentencePieceBackend:
    """A tokenizer.model (no tokenizer.json) through the sentencepiece package, with the few
    methods Tokenizer uses; control tokens written in the text are split out by hand."""

    def __init__(self, processor, add_bos: bool, add_eos: bool):
        self._sp = processor
        self._add_bos, self._add_eos = add_bos, add_eos
        self._control = {processor.id_to_piece(i): i for i in range(processor.get_piece_size())
                         if processor.is_control(i) or processor.is_unknown(i)}

    @classmethod
    def load(cls, path: Path, tok_config: Mapping[str, Any]):
        try:
            import sentencepiece
        except ImportError:
            raise CheckpointError(f"{path.parent} has only tokenizer.model and the sentencepiece package is not "
                                  f"installed; `pip install sentencepiece` or add a tokenizer.json") from None
        processor = sentencepiece.SentencePieceProcessor()
        try:
            processor.Load(str(path))
        except Exception as e:  # sentencepiece raises OSError/RuntimeError depending on version
            raise CheckpointError(f"{path} cannot be loaded ({e}); re-download it") from None
        return cls(processor, bool(tok_config.get("add_bos_token", True)), bool(tok_config.get("add_eos_token", False)))

    def encode(self, text: str, add_special_tokens: bool = False):
        import re
        ids: list[int] = []
        if self._control:
            pattern = "(" + "|".join(re.escape(p) for p in sorted(self._control, key=len, reverse=True)) + ")"
            parts = re.split(pattern, text)
        else:
            parts = [text]
        for part in parts:
            if part in self._control:
                ids.append(self._control[part])
            elif part:
                ids.extend(self._sp.encode(part))
        if add_special_tokens:
            if self._add_bos and self._sp.bos_id() >= 0:
                ids.insert(0, self._sp.bos_id())
            if self._add_eos and self._sp.eos_id() >= 0:
                ids.append(self._sp.eos_id())

        class Encoding:
            pass
        encoding = Encoding()
        encoding.ids = ids
        return encoding

    def decode(self, ids, skip_special_tokens: bool = False):
        if skip_special_tokens:
            ids = [i for i in ids if not self._sp.is_control(i)]
        return self._sp.decode(ids)

    def token_to_id(self, token: str):
        i = self._sp.piece_to_id(token)
        return None if i == self._sp.unk_id() and token != self._sp.id_to_piece(i) else i

    def id_to_token(self, i: int):
        return self._sp.id_to_piece(i) if 0 <= i < self._sp.get_piece_size() else None

    def get_vocab_size(self, with_added_tokens: bool = True):
        return self._sp.get_piece_size()


# ----------------------------------------------------------------------------- helpers

def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); re-download it") from None
    return value if isinstance(value, dict) else {}


def _token_content(token) -> str | None:
    """tokenizer_config.json writes special tokens as "<s>" or {"content": "<s>", ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _token_id(backend, token: str | None) -> int | None:
    return backend.token_to_id(token) if token else None


def _token_str(backend, token_id: int | None) -> str | None:
    return backend.id_to_token(int(token_id)) if token_id is not None else None
