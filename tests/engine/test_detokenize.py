from inference_api.engine.detokenize import IncrementalDetokenizer
from inference_api.mock.tokenizer import ByteTokenizer


def stream(tokenizer, prompt: str, text: str) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer.decode, tokenizer.encode(prompt))
    return [detok.add(t) for t in tokenizer.encode(text)]


def test_multibyte_characters_are_never_split():
    pieces = stream(ByteTokenizer(), "p", "aé日本🎉z")
    assert "".join(pieces) == "aé日本🎉z"
    assert all("\ufffd" not in p for p in pieces)
    # bytes of an incomplete character produce nothing until the character is whole
    assert pieces[:3] == ["a", "", "é"]


def test_real_tokenizer_keeps_spaces_and_unicode(hf_tokenizer):
    text = " The café costs 5€ — 日本語 ok\n\nnext"
    ids = hf_tokenizer.encode(text)
    detok = IncrementalDetokenizer(hf_tokenizer.decode, hf_tokenizer.encode("Prompt:"))
    pieces = [detok.add(t) for t in ids]
    assert "".join(pieces) == hf_tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
