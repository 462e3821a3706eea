"""Tokenizers for training: a built-in byte-level one that needs no files, or any `AutoTokenizer` by name/path.

The built-in tokenizer maps every UTF-8 byte to its own id (0..255) plus one end-of-text token (256), so any text
round-trips exactly and no training or download is needed. It is an ordinary `tokenizers` BPE with no merges, so
`save_pretrained` writes a folder that `transformers.AutoTokenizer` loads without custom code (e.g. after export).
"""
from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from peer.hub import hub_unreachable, offline_mode

BUILTIN_NAME = "builtin"
EOS_TOKEN = "<|endoftext|>"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet `pre_tokenizers.ByteLevel` maps bytes onto."""
    # Printable Latin-1 bytes stand for themselves; the others are shifted past 255 so none is whitespace/control.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table: dict[int, str] = {}
    shift = 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shift)
            shift += 1
    return table


def _builtin_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split: with no merges, word boundaries change nothing and splitting would only cost time.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([EOS_TOKEN])  # takes the next free id, 256
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        # Decoding must give back the exact bytes; clean-up would drop spaces before punctuation.
        clean_up_tokenization_spaces=False,
    )


def build_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """Return the tokenizer called `name`: "builtin" (byte-level, 257 ids) or an `AutoTokenizer` name or path.

    Raises ValueError with one line naming the tokenizer if it cannot be loaded or has no end-of-text token
    (documents are separated by it when packing).
    """
    if name == BUILTIN_NAME:
        return _builtin_tokenizer()
    try:
        try:  # a local folder or the cache first: no network needed
            tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
        except OSError:
            reason = None if offline_mode() else hub_unreachable()
            if reason is not None:
                raise ValueError(f"not in the local cache, and {reason}") from None
            tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError, KeyError, ImportError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot load tokenizer {name!r}: {first}") from None
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {name} has no end-of-text token")
    return tokenizer
