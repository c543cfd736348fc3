"""Code corpus: function extraction, local byte-level BPE round trip, token files and loading."""
import textwrap

import pytest
import torch

from hrlplan.data.code_corpus import CodeCorpus, extract_functions, load_tokenizer, prepare_code_corpus, train_bpe_tokenizer

SOURCE = textwrap.dedent('''
    def add(a, b):
        """Add two numbers."""
        return a + b

    def undocumented(x):
        return x

    class Box:
        def area(self):
            """Width times height."""
            return self.w * self.h
    ''')


def test_extracts_only_functions_with_docstrings():
    records = extract_functions(SOURCE, "m.py")
    assert [r["func_name"] for r in records] == ["add", "area"]
    assert records[1]["code"].startswith("def area(self):") and records[1]["docstring"] == "Width times height."
    assert extract_functions("def broken(:\n", "x.py") == []


def test_byte_level_bpe_round_trips_text():
    tok = train_bpe_tokenizer([SOURCE] * 5, vocab_size=300)
    for text in (SOURCE, "tabs\tand\r\nCRLF  ", "unicode: naïve café → 😀 数据", ""):
        assert tok.decode(tok.encode(text).ids) == text


def _write_sources(root, files=6):
    root.mkdir()
    for i in range(files):
        (root / f"mod{i}.py").write_text(SOURCE.replace("add", f"add{i}") * 3)
    return root


def test_prepare_and_load(tmp_path):
    src = _write_sources(tmp_path / "src")
    out = prepare_code_corpus(str(tmp_path / "code"), vocab_size=300, max_files=5, seed=0, source=str(src),
                              log=lambda _: None)
    corpus = CodeCorpus.load(out)
    assert corpus.train_tokens.dtype == torch.long and corpus.train_tokens.dim() == 1
    assert corpus.val_tokens.numel() > 0 and corpus.vocab_size == 300
    assert int(corpus.train_tokens.max()) < corpus.vocab_size
    assert corpus.meta["files"] == 5
    text = corpus.decode(corpus.train_tokens[:200])
    assert "def " in text and "<|endoftext|>" in text
    # same settings: reused, not rebuilt
    mtime = (tmp_path / "code" / "meta.json").stat().st_mtime_ns
    prepare_code_corpus(str(tmp_path / "code"), vocab_size=300, max_files=5, seed=0, source=str(src), log=lambda _: None)
    assert (tmp_path / "code" / "meta.json").stat().st_mtime_ns == mtime


def test_user_tokenizer_file_is_used(tmp_path):
    src = _write_sources(tmp_path / "src", files=3)
    tok = train_bpe_tokenizer([SOURCE], vocab_size=280)
    tok.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(str(tmp_path)).get_vocab_size() == tok.get_vocab_size()
    out = prepare_code_corpus(str(tmp_path / "code"), vocab_size=4096, max_files=3, seed=0, source=str(src),
                              tokenizer=str(tmp_path / "tokenizer.json"), log=lambda _: None)
    assert CodeCorpus.load(out).vocab_size == tok.get_vocab_size()


def test_missing_corpus_and_tokenizer_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="build-code-corpus"):
        CodeCorpus.load(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no downloads"):
        load_tokenizer("surely-not/a-cached-model")
