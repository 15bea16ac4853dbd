"""Tokenizer: encode/decode, chat templates, streaming decode, GGUF-built vocabularies."""
import json
import os
from pathlib import Path

import pytest

from kog_core.errors import CheckpointError, KogError
from kog_core.tokenizer import ChatTemplateError, Tokenizer

DEMO_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def byte_level_meta(merges=(), pre="default", extra_tokens=(), template=CHATML, add_bos=None) -> dict:
    """GGUF tokenizer metadata for a byte-level BPE: 3 control tokens + the 256 byte symbols."""
    from tokenizers.pre_tokenizers import ByteLevel
    alphabet = sorted(ByteLevel.alphabet())
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + alphabet + list(extra_tokens)
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (len(tokens) - 3),
            "tokenizer.ggml.merges": list(merges), "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.chat_template": template}
    if add_bos is not None:
        meta["tokenizer.ggml.add_bos_token"] = add_bos
    return meta


@pytest.fixture
def bytes_tokenizer():
    return Tokenizer.from_gguf_metadata(byte_level_meta(merges=["h e", "l l", "he ll"], extra_tokens=["he", "ll", "hell"]))


# ----------------------------------------------------------------------------- encode / decode

def test_byte_level_bpe_encode_decode(bytes_tokenizer):
    tok = bytes_tokenizer
    ids = tok.encode("hello")
    assert [tok.id_to_token(i) for i in ids] == ["hell", "o"]
    text = "héllo wörld 🙂\n\tend"
    assert tok.decode(tok.encode(text)) == text
    assert tok.vocab_size == 3 + 256 + 3


def test_special_tokens_are_single_ids_and_skippable(bytes_tokenizer):
    tok = bytes_tokenizer
    ids = tok.encode("<|im_start|>hi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 4
    assert tok.decode(ids, skip_special_tokens=True) == "hi"
    assert tok.decode(ids) == "<|im_start|>hi<|im_end|>"


def test_add_special_tokens_follows_gguf_add_bos():
    with_bos = Tokenizer.from_gguf_metadata(byte_level_meta(add_bos=True))
    without = Tokenizer.from_gguf_metadata(byte_level_meta())
    assert with_bos.encode("a", add_special_tokens=True)[0] == 1
    assert with_bos.encode("a") == without.encode("a", add_special_tokens=True) == without.encode("a")


def test_smollm_pre_tokenizer_splits_digits():
    tok = Tokenizer.from_gguf_metadata(byte_level_meta(merges=["1 2"], pre="smollm", extra_tokens=["12"]))
    assert len(tok.encode("12")) == 2  # individual digits: the "1 2" merge never applies
    default = Tokenizer.from_gguf_metadata(byte_level_meta(merges=["1 2"], extra_tokens=["12"]))
    assert len(default.encode("12")) == 1


# ----------------------------------------------------------------------------- streaming

def test_stream_decoder_holds_back_incomplete_utf8(bytes_tokenizer):
    tok = bytes_tokenizer
    ids = tok.encode("a🙂")  # the emoji is 4 byte tokens
    assert len(ids) == 5
    stream = tok.stream_decoder()
    deltas = [stream.push(i) for i in ids]
    assert deltas == ["a", "", "", "", "🙂"]
    assert stream.flush() == ""


def test_stream_decoder_reassembles_text(bytes_tokenizer):
    text = "hello, wörld! 日本語 🙂🙂 done"
    stream = bytes_tokenizer.stream_decoder()
    assert "".join(stream.push(i) for i in bytes_tokenizer.encode(text)) + stream.flush() == text


def test_stream_decoder_flush_emits_an_incomplete_tail(bytes_tokenizer):
    ids = bytes_tokenizer.encode("🙂")[:2]
    stream = bytes_tokenizer.stream_decoder()
    assert [stream.push(i) for i in ids] == ["", ""]
    assert stream.flush() == "\ufffd"


# ----------------------------------------------------------------------------- chat templates

def test_chat_template_and_encode_chat(bytes_tokenizer):
    tok = bytes_tokenizer
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"
    ids = tok.encode_chat(messages)
    assert ids[0] == 1 and tok.decode(ids) == tok.apply_chat_template(messages)


def test_encode_chat_does_not_double_bos():
    meta = byte_level_meta(template="{{ bos_token }}{{ messages[0]['content'] }}", add_bos=True)
    tok = Tokenizer.from_gguf_metadata(meta)
    ids = tok.encode_chat([{"role": "user", "content": "x"}])
    assert ids == [1, tok.token_to_id("x")]


def test_chat_template_features_like_transformers(bytes_tokenizer):
    tok = bytes_tokenizer
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'bad' %}{{ raise_exception('roles must alternate') }}"
                         "{% endif %}{% generation %}{{ m | tojson }}{% endgeneration %}{% endfor %}{{ eos_token }}")
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == '{"role": "user", "content": "é"}<|im_end|>'
    with pytest.raises(ChatTemplateError, match="roles must alternate") as info:
        tok.apply_chat_template([{"role": "bad", "content": ""}])
    assert isinstance(info.value, KogError)
    tok.chat_template = "{% for %}"
    with pytest.raises(ChatTemplateError, match="does not compile"):
        tok.apply_chat_template([])
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([])


def test_template_sandbox_blocks_attribute_escape(bytes_tokenizer):
    bytes_tokenizer.chat_template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(ChatTemplateError):
        bytes_tokenizer.apply_chat_template([])


# ----------------------------------------------------------------------------- Hugging Face directories

def write_hf_tokenizer(directory: Path, tok_config: dict, generation_config: dict | None = None):
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, models, pre_tokenizers
    vocab = {"<s>": 0, "</s>": 1, "<eot>": 2, "hello": 3, "world": 4, "[UNK]": 5}
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", "<eot>")])
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config))
    if generation_config is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation_config))


def test_from_hf_dir_reads_special_tokens_and_eos_list(tmp_path):
    write_hf_tokenizer(tmp_path, {"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>",
                                  "chat_template": [{"name": "default", "template": "{{ bos_token }}D"},
                                                    {"name": "tool_use", "template": "T"}]},
                       {"eos_token_id": [1, 2]})
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.bos_token_id == 0 and tok.eos_token_ids == {1, 2}
    assert tok.apply_chat_template([]) == "<s>D"
    assert tok.encode("hello world") == [3, 4]
    assert tok.decode([0, 3], skip_special_tokens=True) == "hello"


def test_from_hf_dir_prefers_chat_template_jinja_and_config_eos(tmp_path):
    write_hf_tokenizer(tmp_path, {"chat_template": "old"})
    (tmp_path / "chat_template.jinja").write_text("new")
    tok = Tokenizer.from_hf_dir(tmp_path, {"eos_token_id": 2, "bos_token_id": 0})
    assert tok.chat_template == "new" and tok.eos_token_ids == {2} and tok.bos_token_id == 0


def test_from_hf_dir_without_tokenizer_files(tmp_path):
    with pytest.raises(CheckpointError, match="no tokenizer.json or tokenizer.model"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"\0")
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        with pytest.raises(CheckpointError, match="sentencepiece"):
            Tokenizer.from_hf_dir(tmp_path)


# ----------------------------------------------------------------------------- GGUF sentencepiece

def spm_meta(add_space_prefix=True) -> dict:
    """A tiny llama-style vocabulary: <unk>, <s>, </s>, byte tokens, then scored pieces."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    pieces = {"\u2581": -1.0, "h": -2.0, "e": -2.0, "l": -2.0, "o": -2.0, "w": -2.0, "r": -2.0, "d": -2.0,
              "ll": -3.0, "he": -4.0, "\u2581he": -5.0, "\u2581hell": -6.0, "\u2581hello": -7.0, "\u2581w": -8.0,
              "or": -9.0}
    scores = [0.0] * len(tokens) + list(pieces.values())
    tokens += list(pieces)
    types += [1] * len(pieces)
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_space_prefix": add_space_prefix}


def test_gguf_sentencepiece_vocabulary():
    tok = Tokenizer.from_gguf_metadata(spm_meta())
    ids = tok.encode("hello world")
    assert [tok.id_to_token(i) for i in ids] == ["\u2581hello", "\u2581w", "or", "l", "d"]
    assert tok.decode(ids) == "hello world"
    assert tok.encode("hi", add_special_tokens=True)[0] == 1  # llama GGUFs add BOS by default
    assert tok.encode("x")[1:] == [tok.token_to_id("<0x78>")]  # unknown piece: byte fallback
    assert tok.decode(tok.encode("hé 🙂")) == "hé 🙂"
    assert tok.decode(tok.encode("<s>hello</s>"), skip_special_tokens=True) == "hello"


def test_unsupported_gguf_tokenizer_model():
    with pytest.raises(CheckpointError, match="'bert' is not supported"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})


# ----------------------------------------------------------------------------- the real demo model

@pytest.fixture(scope="module")
def demo_tokenizer():
    from kog_core.checkpoint.gguf_loader import metadata, open_reader
    from kog_core.hub import cache_dir
    path = Path(os.environ["KOG_TEST_GGUF"]) if os.environ.get("KOG_TEST_GGUF") else \
        cache_dir() / "models" / "smollm2-135m" / DEMO_GGUF_NAME
    if not path.is_file():
        pytest.skip("demo GGUF not found: set KOG_TEST_GGUF or run `kog pull smollm2-135m`")
    return Tokenizer.from_gguf_metadata(metadata(open_reader(path)))


def test_demo_chat_prompt(demo_tokenizer):
    tok = demo_tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(messages)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tok.encode_chat(messages)
    # ids as the Hugging Face tokenizer of SmolLM2-135M-Instruct produces them
    assert ids[:3] == [1, 9690, 198] and ids[-4:] == [1, 520, 9531, 198]
    assert ids.count(1) == 3 and ids.count(2) == 2
    assert tok.bos_token_id == 1 and tok.eos_token_ids == {2} and tok.vocab_size == 49152


def test_demo_round_trip(demo_tokenizer):
    text = "Hello world! 12345 héllo 日本語 🙂  spaces\n\nnew"
    ids = demo_tokenizer.encode(text)
    assert ids[:4] == [19556, 905, 17, 216] and ids[4:9] == [33, 34, 35, 36, 37]  # digits split one by one
    assert demo_tokenizer.decode(ids) == text
    stream = demo_tokenizer.stream_decoder()
    assert "".join(stream.push(i) for i in ids) + stream.flush() == text


def test_tokenizer_model_only_directory_goes_through_sentencepiece(tmp_path):
    """A Llama-2-style checkpoint folder with tokenizer.model and no tokenizer.json."""
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(["the quick brown fox jumps over the lazy dog", "hello world, hello kog",
                                 "decode speed at batch one is memory bound"] * 50))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "tokenizer"), vocab_size=60,
                                   model_type="bpe", bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
                                   minloglevel=2)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True, "bos_token": "<s>",
                                                                "eos_token": "</s>"}))
    from kog_core.tokenizer import Tokenizer
    tok = Tokenizer.from_hf_dir(tmp_path)
    ids = tok.encode("hello world", add_special_tokens=True)
    assert ids[0] == 1 and len(ids) > 2
    assert tok.decode(ids, skip_special_tokens=True) == "hello world"
    assert 2 in tok.eos_token_ids
