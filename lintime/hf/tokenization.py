"""A lintime tokenizer as an HF ``PreTrainedTokenizerFast`` that produces the same ids.

* Byte tokenizer: a ``tokenizers`` byte-level model (GPT-2's byte -> character map, then a
  256-entry vocabulary with no merges) that maps byte ``b`` to id ``b``; the specials are added
  after it, so ``<pad>`` 256, ``<bos>`` 257, ``<eos>`` 258, ``<mask>`` 259, as in
  :class:`~lintime.data.ByteTokenizer`.
* BPE: the trained ``tokenizers`` model itself, with its special tokens.

In both, special-token *text* in the input is encoded as ordinary text
(``split_special_tokens=True``), as lintime's ``encode`` does, and the tokenizer adds ``<bos>`` in
front of every text (``add_special_tokens=True``, the default): training wraps every document in
bos/eos and ``lintime generate`` prefixes the prompt with bos, so ``tokenizer(prompt)`` gives
exactly the ids lintime feeds.  Call with ``add_special_tokens=False`` for the bare ids.
"""

from __future__ import annotations

import copy

from lintime.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ``ByteLevel`` pre-tokenizes to)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _byte_backend():
    from tokenizers import Tokenizer as TkTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    chars = _bytes_to_unicode()
    tok = TkTokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = {"pad": "<pad>", "bos": "<bos>", "eos": "<eos>", "mask": "<mask>"}
    tok.add_special_tokens([specials[r] for r in ("pad", "bos", "eos", "mask")])  # ids 256..259 in order
    return tok, specials


def hf_tokenizer(tokenizer: Tokenizer, *, model_max_length: int | None = None):
    """``tokenizer`` (lintime :class:`ByteTokenizer` or :class:`BPETokenizer`) as a
    ``transformers.PreTrainedTokenizerFast`` whose ids equal lintime's (see the module docstring).
    ``model_max_length``: recorded for tools that truncate (e.g. a learned position table)."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    if isinstance(tokenizer, ByteTokenizer):
        backend, specials = _byte_backend()
    elif isinstance(tokenizer, BPETokenizer):
        backend = copy.deepcopy(tokenizer.hf_tokenizer)
        specials = dict(tokenizer.special_tokens)
    else:
        raise TypeError(f"no HF conversion for tokenizer {type(tokenizer).__name__}")
    bos = specials["bos"]
    bos_id = backend.token_to_id(bos)
    if bos_id != tokenizer.bos_id:
        raise ValueError(f"tokenizer conversion: bos {bos!r} has id {bos_id}, lintime says {tokenizer.bos_id}")
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, bos_id)]
    )
    kwargs = {}
    if model_max_length is not None:
        kwargs["model_max_length"] = model_max_length
    out = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=specials["bos"], eos_token=specials["eos"], pad_token=specials["pad"],
        mask_token=specials["mask"], split_special_tokens=True, padding_side="left",
        clean_up_tokenization_spaces=False, **kwargs,
    )
    for role in ("pad", "bos", "eos", "mask"):
        got, want = getattr(out, f"{role}_token_id"), getattr(tokenizer, f"{role}_id")
        if got != want:
            raise ValueError(f"tokenizer conversion: {role} id {got} != lintime's {want}")
    return out
