"""Tokenizers: characters (the classic tiny-Shakespeare setup) and byte-level BPE (the `tokenizers` library).

Both speak the same small interface (`Tokenizer`): encode, decode, vocab_size, eos_id, save, name, fingerprint.
A tokenizer a run trains has one special token after its vocabulary, the end of a document (Llama's
`<|end_of_text|>`): training puts it after each file of a corpus of several (data.py), generation stops at
it, and exports declare it as EOS. Tokenizers saved before it existed have none (`eos_id` None).

Text is text: `encode` never turns the spelling of a special token into that token, in either kind of
tokenizer, whether the text is a training file, a prompt or a chat message (as nanoGPT's `encode_ordinary`
does). Otherwise a client could write `<|eot|>` into a message and close its turn, or forge a system turn.
Special tokens come only from the code that means them: the document boundary (data.py), an id a client
sends as an id, and a chat template's own output, which reaches `encode_pieces` as `Markup` pieces.
The fingerprint is a hash of the saved JSON, so that the data cache (data.py) can tell tokenizers apart
without trusting file names. `load_tokenizer` reads either format back from its JSON file.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from ..base.errors import GenerationError, TokenizerError
from ..base.files import JSON_LIMIT, read_bytes


class UnknownCharacters(TokenizerError):
    """Text with characters a character tokenizer does not know; `listing` names them."""

    def __init__(self, message: str, listing: str) -> None:
        super().__init__(message)
        self.listing = listing


CHAR_KIND = "nanollama4-char"  # the "kind" key that marks our character-tokenizer JSON
END_OF_TEXT = "<|end_of_text|>"  # the end-of-document token, as Llama spells it
TEXT_RULE = "special-spellings-are-text\n"  # the encoding rule, in every fingerprint (see the module's docstring)
_MAX_SHOWN = 20  # unknown characters listed in an error message


@runtime_checkable
class Tokenizer(Protocol):
    """What the rest of the package needs from a tokenizer."""

    name: str

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int | None: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def save(self, path: str | Path) -> None: ...

    def save_hf(self, path: str | Path) -> None: ...

    def fingerprint(self) -> str: ...


def _fingerprint(content: str) -> str:
    """Short sha256 hex of a tokenizer's saved JSON: 16 hex digits are plenty to key a cache."""
    return hashlib.sha256(content.encode("utf-8")).hexdigest()[:16]


def _as_int_list(ids: Iterable[int]) -> list[int]:
    """Accept lists, numpy arrays and torch tensors alike (both have .tolist(), which gives Python ints)."""
    tolist = getattr(ids, "tolist", None)
    return tolist() if callable(tolist) else [int(i) for i in ids]


# ---------------------------------------------------------------------------------------------- characters
class _SavedAsJson:
    """save() and fingerprint() for a tokenizer whose whole state is its to_json() text."""

    def to_json(self) -> str:
        raise NotImplementedError

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json(), encoding="utf-8")

    def fingerprint(self) -> str:
        """Names the encoding rule too, so that a token cache made when a special token's spelling in a
        training file became the token is not reused now that it stays text."""
        return _fingerprint(TEXT_RULE + self.to_json())


class CharTokenizer(_SavedAsJson):
    """One id per character, ids in sorted character order, then the end-of-text token when `end_of_text`
    (id len(chars)). Unknown characters are an error unless a `replace` character is given, so that a corpus
    never silently loses text."""

    name = "char"

    def __init__(self, chars: Iterable[str], replace: str | None = None, end_of_text: bool = False) -> None:
        self.chars: list[str] = list(chars)
        self.end_of_text = bool(end_of_text)
        if not self.chars:
            raise TokenizerError("a character tokenizer needs at least one character; build it from non-empty text")
        bad = [c for c in self.chars if not isinstance(c, str) or len(c) != 1]
        if bad:
            raise TokenizerError(f"vocabulary entries must be single characters, got {bad[:_MAX_SHOWN]!r}")
        if len(set(self.chars)) != len(self.chars):
            raise TokenizerError("the character vocabulary has duplicates; each character must appear once")
        surrogates = [c for c in self.chars if "\ud800" <= c <= "\udfff"]
        if surrogates:  # JSON can spell one, no text holds one: exports and decoding would fail on it later
            raise TokenizerError(f"the character vocabulary holds lone surrogates {surrogates[:_MAX_SHOWN]!r}, "
                                 "which are not text; the tokenizer is corrupt: rebuild it from the corpus")
        self.stoi: dict[str, int] = {c: i for i, c in enumerate(self.chars)}
        self.replace = replace
        if replace is not None:
            self._replacement_id(replace)  # validate now, not at the first unknown character

    @classmethod
    def from_text(cls, text: str, replace: str | None = None, end_of_text: bool = False) -> CharTokenizer:
        """The vocabulary is the sorted set of characters of `text` (and the end-of-text token when asked)."""
        if not text:
            raise TokenizerError("cannot build a character vocabulary from empty text; pass the training corpus")
        return cls(sorted(set(text)), replace=replace, end_of_text=end_of_text)

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + self.end_of_text

    @property
    def eos_id(self) -> int | None:
        return len(self.chars) if self.end_of_text else None

    @property
    def special_tokens(self) -> dict[str, int]:
        """Spelling -> id of the special tokens: the end-of-text token, when the tokenizer has it."""
        return {END_OF_TEXT: len(self.chars)} if self.end_of_text else {}

    def _replacement_id(self, replace: str) -> int:
        if replace not in self.stoi:
            raise TokenizerError(f"replacement {replace!r} is not in the vocabulary; pick a character that is "
                                 "(e.g. ' ' or '?')")
        return self.stoi[replace]

    def encode(self, text: str, replace: str | None = None) -> list[int]:
        """Ids of the characters of `text`. `replace` (here or in the constructor) maps unknown characters
        to that character's id; without it an unknown character raises TokenizerError listing them."""
        replace = replace if replace is not None else self.replace
        unknown = set(text).difference(self.stoi)
        if not unknown:
            return [self.stoi[c] for c in text]
        if replace is None:
            shown = ", ".join(repr(c) for c in sorted(unknown)[:_MAX_SHOWN])
            more = f" (and {len(unknown) - _MAX_SHOWN} more)" if len(unknown) > _MAX_SHOWN else ""
            noun = "character" if len(unknown) == 1 else "characters"
            listing = f"{len(unknown)} {noun} not in the vocabulary: {shown}{more}"
            raise UnknownCharacters(f"cannot encode {listing}; substitute a character that is in it "
                                    "(--replace-unknown '?' on the command line, replace='?' in Python)", listing)
        rid = self._replacement_id(replace)
        return [self.stoi.get(c, rid) for c in text]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`; the end-of-text token reads as its spelling, as transformers decodes it."""
        ids = _as_int_list(ids)
        n = self.vocab_size
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise TokenizerError(f"cannot decode ids outside the vocabulary [0, {n}): {bad[:_MAX_SHOWN]}")
        chars = [*self.chars, END_OF_TEXT] if self.end_of_text else self.chars
        return "".join(chars[i] for i in ids)

    def to_json(self) -> str:
        """The saved form: {"kind": "nanollama4-char", "chars": [...]} (+ "end_of_text" with its spelling when
        the tokenizer has it, + "replace" when one is set)."""
        state: dict[str, Any] = {"kind": CHAR_KIND, "chars": self.chars}
        if self.end_of_text:
            state["end_of_text"] = END_OF_TEXT
        if self.replace is not None:
            state["replace"] = self.replace  # it changes what encode returns, so it belongs to the fingerprint
        return json.dumps(state, ensure_ascii=False)

    def to_hf(self) -> HFTokenizer:
        """The same tokenizer in the `tokenizers` library's format, which transformers' AutoTokenizer loads:
        a BPE model whose vocabulary is the characters and which has no merges (so every character is its
        own token, at our id), and a decoder that joins the tokens as they are. (`tokenizer_from_json`
        reads such a file back as a CharTokenizer.) Unknown characters are the library's business there:
        they encode to nothing. The end-of-text token is an added special token at our id."""
        tok = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(self.chars)}, merges=[]))
        tok.decoder = decoders.Fuse()
        if self.end_of_text:
            tok.add_special_tokens([AddedToken(END_OF_TEXT, special=True)])
        return tok

    def save_hf(self, path: str | Path) -> None:
        """tokenizer.json as transformers reads it (`to_hf`), for exports."""
        self.to_hf().save(str(path))

    @classmethod
    def from_hf_state(cls, state: dict[str, Any]) -> CharTokenizer | None:
        """The CharTokenizer a `to_hf` file holds, or None when the JSON is not one (any other tokenizer)."""
        model, decoder = state.get("model") or {}, state.get("decoder") or {}
        vocab = model.get("vocab") if isinstance(model, dict) else None
        added = state.get("added_tokens") or []
        if not (isinstance(model, dict) and model.get("type") == "BPE" and model.get("merges") == []
                and isinstance(decoder, dict) and decoder.get("type") == "Fuse" and isinstance(vocab, dict)
                and not state.get("pre_tokenizer") and isinstance(added, list) and vocab):
            return None
        chars = sorted(vocab, key=lambda c: vocab[c])
        if [vocab[c] for c in chars] != list(range(len(chars))) or any(len(c) != 1 for c in chars):
            return None
        if added and [(a.get("content"), a.get("id")) for a in added if isinstance(a, dict)] != [
                (END_OF_TEXT, len(chars))]:
            return None  # added tokens other than our end-of-text: not an exported character tokenizer
        return cls(chars, end_of_text=bool(added))

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> CharTokenizer:
        chars = state.get("chars")
        if not isinstance(chars, list):
            raise TokenizerError('a character tokenizer JSON needs a "chars" list of single characters')
        end = state.get("end_of_text")
        if end not in (None, END_OF_TEXT):
            raise TokenizerError(f'a character tokenizer\'s "end_of_text" must be {END_OF_TEXT!r} (or absent)')
        return cls(chars, replace=state.get("replace"), end_of_text=end is not None)

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


# ---------------------------------------------------------------------------------------------- byte-level BPE
class BPETokenizer(_SavedAsJson):
    """A `tokenizers.Tokenizer`, usually byte-level BPE: any text encodes (no unknown characters) and
    decoding gives the text back exactly. Also wraps tokenizer.json files of reference checkpoints."""

    name = "bpe"

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self.tokenizer = tokenizer
        # The library then reads a special token's spelling in a text as the text it is. Set once here, never
        # toggled: a setter racing an encode on another thread would fail on the Rust side.
        tokenizer.encode_special_tokens = True

    @classmethod
    def train(cls, texts: str | Iterable[str], vocab_size: int, min_frequency: int = 2,
              end_of_text: bool = False) -> BPETokenizer:
        """Train byte-level BPE on a string or an iterator of strings, up to `vocab_size` tokens (the 256
        byte symbols and, when `end_of_text`, the end-of-text token last, included; fewer if the text runs out
        of pairs seen `min_frequency` times)."""
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        if vocab_size < len(alphabet):
            raise TokenizerError(f"vocab_size ({vocab_size}) must be at least {len(alphabet)}, the byte alphabet "
                                 "of byte-level BPE; use the char tokenizer for smaller vocabularies")
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size - end_of_text, min_frequency=min_frequency,
                                      initial_alphabet=alphabet, show_progress=False)
        tok.train_from_iterator(_chunks(texts) if isinstance(texts, str) else texts, trainer=trainer)
        if end_of_text:
            tok.add_special_tokens([AddedToken(END_OF_TEXT, special=True)])
        return cls(tok)

    @classmethod
    def from_file(cls, path: str | Path) -> BPETokenizer:
        """Load any tokenizer.json written by the `tokenizers` library."""
        return cls(_hf_from_str(_read_text(Path(path)), Path(path)))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int | None:
        """The end-of-text token's id: ours, or a reference tokenizer's of that spelling (Llama's)."""
        return self.tokenizer.token_to_id(END_OF_TEXT)

    def encode(self, text: str) -> list[int]:
        """The ids of `text` as text: a special token's spelling in it is bytes like any other."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text; the library encodes them in parallel on every core."""
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    @property
    def special_tokens(self) -> dict[str, int]:
        """Spelling -> id of the tokens the library marks special (ours: end-of-text; Llama 4's: its
        headers, end of turn, ...): what a chat template's markup may name."""
        return {t.content: i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special}

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(_as_int_list(ids), skip_special_tokens=False)

    def to_json(self) -> str:
        return self.tokenizer.to_str()

    def save_hf(self, path: str | Path) -> None:
        """tokenizer.json as transformers reads it: already the `tokenizers` format."""
        self.save(path)

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size})"


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's spelling of bytes as characters, reversed: printable Latin-1 bytes stand for
    themselves, and the other bytes, in order, for the characters from U+0100 on."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    moved = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(0x100 + n): b for n, b in enumerate(moved)}


_BYTE_OF = _byte_level_alphabet()
_SPELLING = {b: c for c, b in _BYTE_OF.items()}


def byte_level_spelling(text: str) -> str:
    """`text` as byte-level BPE spells it: its UTF-8 bytes, each as its alphabet character (" " is "Ġ")."""
    return "".join(_SPELLING[b] for b in text.encode("utf-8"))


def check_prompt(text: str, fix: str, name: str = "prompt") -> None:
    """Refuse, in one line ending with `fix`, an empty prompt or one that is not text: a lone surrogate
    (\\ud800-\\udfff), which is how a shell hands over bytes that are not UTF-8 and JSON can spell."""
    if not text:
        raise GenerationError(f"the {name} is empty; {fix}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise GenerationError(f"the {name} is not valid text (a lone surrogate, \\ud800-\\udfff: bytes that "
                              f"were not UTF-8); {fix}") from None


class Markup(str):
    """A piece of a chat template's own output that spells one special token: the token it becomes."""


class Rendered(str):
    """Text a chat template wrote, with its pieces: each `Markup` (the template's own special tokens) or plain
    text (what the conversation said, and the template's other words), encoded as text."""

    pieces: tuple[str, ...]

    def __new__(cls, pieces: Iterable[str]) -> Rendered:
        pieces = tuple(p for p in pieces if p)
        rendered = super().__new__(cls, "".join(pieces))
        rendered.pieces = pieces
        return rendered


@functools.lru_cache(maxsize=8)
def _markup(specials: frozenset[str]) -> tuple[re.Pattern | None, re.Pattern | None, tuple[int, ...]]:
    """For `split_markup` and `break_markup`: where a spelling may start (its first two characters: a few
    patterns, so a scan is linear in the text however many special tokens there are; Llama 4 has over a
    thousand), the places between those two characters, and the spellings' lengths, longest first."""
    pairs = sorted({s[:2] for s in specials if len(s) > 1})
    if not pairs:
        return None, None, ()
    starts = re.compile("(?=" + "|".join(re.escape(p) for p in pairs) + ")")
    between = re.compile("|".join(f"(?<={re.escape(p[0])})(?={re.escape(p[1])})" for p in pairs))
    return starts, between, tuple(sorted({len(s) for s in specials if len(s) > 1}, reverse=True))


def split_markup(text: str, specials: Iterable[str]) -> list[str]:
    """`text` cut at each spelling of `specials` (the longest where two start at one place), those pieces as
    `Markup`. A one-character special is left as text: no text could then say that character."""
    specials = frozenset(specials)
    starts, _, lengths = _markup(specials)
    pieces, done = [], 0
    for m in starts.finditer(text) if starts is not None else ():
        i = m.start()
        spelling = next((text[i:i + n] for n in lengths if i >= done and text[i:i + n] in specials), None)
        if spelling is not None:
            pieces += [text[done:i], Markup(spelling)]
            done = i + len(spelling)
    return [p for p in (*pieces, text[done:]) if p]


def break_markup(text: str, specials: Iterable[str], guard: str) -> str:
    """`text` with `guard` put between the first two characters of wherever a spelling of `specials` could
    start, so that none of them is left whole in it (`split_markup` finds none); taking `guard` out gives the
    text back."""
    _, between, _ = _markup(frozenset(specials))
    return text if between is None else between.sub(guard, text)


def encode_pieces(tokenizer: Tokenizer, pieces: Iterable[str]) -> list[int]:
    """The ids of `pieces`: a `Markup` piece is its special token, any other piece is encoded as text. Pieces
    are encoded apart, as the tokenizers library encodes the text between two special tokens."""
    specials: dict[str, int] = getattr(tokenizer, "special_tokens", {})
    ids: list[int] = []
    for piece in pieces:
        if isinstance(piece, Markup):
            if piece not in specials:
                raise TokenizerError(f"{piece!r} is not a special token of this tokenizer")
            ids.append(specials[piece])
        elif piece:
            ids.extend(tokenizer.encode(piece))
    return ids


def prompt_ids(tokenizer: Tokenizer, text: str, fix: str, name: str = "prompt") -> list[int]:
    """A prompt's ids, every door's one check: `check_prompt`, then the tokenizer's own refusal (an unknown
    character), then a prompt that encodes to no tokens. A chat template's `Rendered` text is encoded by its
    pieces (its markup as special tokens); any other text is text, whatever it spells."""
    check_prompt(text, fix, name)
    ids = encode_pieces(tokenizer, text.pieces) if isinstance(text, Rendered) else tokenizer.encode(text)
    if not ids:
        raise GenerationError(f"the {name} encodes to no tokens; {fix}")
    return ids


def token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    """The bytes one token stands for. A byte-level BPE token may be part of a character (its decoding
    alone is then U+FFFD, the same for all of them): its own bytes are read from its spelling."""
    if isinstance(tokenizer, BPETokenizer) and type(tokenizer.tokenizer.decoder).__name__ == "ByteLevel":
        piece = tokenizer.tokenizer.id_to_token(token_id)
        if piece is not None and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
    return tokenizer.decode([token_id]).encode("utf-8")


def token_label(raw: bytes) -> str:
    """A token's text as the API names it: its text when its bytes are whole UTF-8, else `bytes:\\xNN...`
    (as OpenAI names such tokens), so that no two tokens of different bytes share a name."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _chunks(text: str, lines_per_chunk: int = 1000) -> Iterator[str]:
    """Split one long training string at line ends, so the trainer can work on the pieces in parallel."""
    lines = text.splitlines(keepends=True)
    for i in range(0, len(lines), lines_per_chunk):
        yield "".join(lines[i:i + lines_per_chunk])


# ---------------------------------------------------------------------------------------------- loading
def _read_text(path: Path) -> str:
    if not path.exists():
        raise TokenizerError(f"tokenizer file {path} does not exist; pass the path of a saved tokenizer "
                             "(tokenizer.json) or train one first")
    data = read_bytes(path, JSON_LIMIT, "a tokenizer.json of ours", TokenizerError)  # a FIFO, /dev/zero: refused
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TokenizerError(f"tokenizer file {path} is not UTF-8 text (byte offset {e.start}); pass a "
                             "tokenizer.json saved by nanollama4 or the tokenizers library") from None


def _hf_from_str(content: str, path: Path) -> HFTokenizer:
    try:
        return HFTokenizer.from_str(content)
    except Exception as e:  # the Rust side raises plain Exception subclasses with multi-line text
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TokenizerError(f"{path} is not a tokenizer.json the tokenizers library can read ({reason}); "
                             "pass a file saved by nanollama4 or by the tokenizers library") from e


def replacing_unknown(tokenizer: Tokenizer, char: str) -> Tokenizer:
    """The tokenizer, mapping characters it does not know to `char` (byte-level BPE knows every character)."""
    if isinstance(tokenizer, CharTokenizer):
        return CharTokenizer(tokenizer.chars, replace=char, end_of_text=tokenizer.end_of_text)
    return tokenizer


def load_tokenizer(path: str | Path) -> CharTokenizer | BPETokenizer:
    """Load a saved tokenizer: our character JSON (by its "kind") or any `tokenizers` tokenizer.json."""
    path = Path(path)
    return tokenizer_from_json(_read_text(path), path)


def tokenizer_from_json(content: str, path: str | Path = "(tokenizer JSON)") -> CharTokenizer | BPETokenizer:
    """A tokenizer from the text `load_tokenizer` reads from a file (`path` only names it in errors)."""
    path = Path(path)
    try:
        state = json.loads(content)
    except json.JSONDecodeError as e:
        raise TokenizerError(f"tokenizer file {path} is not valid JSON ({e.msg} at line {e.lineno}); "
                             "pass a tokenizer.json saved by nanollama4 or the tokenizers library") from e
    except RecursionError:
        raise TokenizerError(f"tokenizer file {path} nests its JSON too deeply to be a tokenizer; it is "
                             "corrupt") from None
    if not isinstance(state, dict):
        raise TokenizerError(f"tokenizer file {path} holds JSON but not an object; pass a saved tokenizer.json")
    if state.get("kind") == CHAR_KIND:
        try:
            return CharTokenizer.from_dict(state)
        except TokenizerError as e:
            raise TokenizerError(f"tokenizer file {path}: {e}") from e
    chars = CharTokenizer.from_hf_state(state)  # an exported character tokenizer: ours again, errors and all
    return chars if chars is not None else BPETokenizer(_hf_from_str(content, path))
