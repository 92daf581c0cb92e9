"""A run's text read back: the one reader (`read_run_text`) of the corpus a run was trained on and of its
validation text, for every command that reads them: `eval`, `experts`, `compare --experts`, `export
--drop-bias`, the experiments' readings, and `train --resume`.

A run records where its text was (train_state.json's "data", train_config.json's "val_data") and the
sha256 of what it read there ("corpus_sha256", and "val_sha256" since runs record it). Two rules follow.

- **The text must still be the one the run recorded.** A corpus appended to since training has another
  validation split: `eval` would score other tokens and keep the number in evaluation.json as the run's,
  with nothing to say so. Where the sha256 differs the reader refuses in one line. A text the user names
  (--data) that is not the run's is read as another text (`RunText.own` False), and the command says so.
- **A run folder names no file to read.** Run folders are shared and downloaded, and a crafted
  train_state.json could name /etc/passwd or ~/.ssh/id_ed25519 for `experts` to print contexts from. So a
  path that a run folder names is read only where the folder also records the sha256 of its text and the
  text there has it: the file then holds exactly what the folder's author already had, and reading it
  tells them nothing. It is hashed before it is tokenized, and a failure to read it is reported without
  its bytes. What the user names (--data) and the package's default corpus are read as asked. A run saved
  before its validation text's sha256 was recorded has that text refused by the same rule (--data TEXT
  names it: the text is then scored, or routed, whole).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..base.config import TrainConfig
from ..base.errors import DataError, shown
from ..model.tokenizer import Tokenizer
from .corpus import find_corpus_files
from .data import TokenDataset, default_cache_dir, text_digest
from .runs import corpus_of, token_dataset

# What each kind of reader tells the user to do when the run's text cannot be read back (the end of the line).
FIX_EVAL = "pass --data TEXT: the text it was trained on, from wherever it is now, or another text, scored whole"
FIX_EXPERTS = "pass --data TEXT to route a text you name"
FIX_OTHERS = "give it back the text it was trained on (`nanollama4 eval RUN --data TEXT` reads it from elsewhere)"


@dataclass
class RunText:
    """What `read_run_text` read: the corpus as ids, joined with the run's validation text where it had one."""

    dataset: TokenDataset  # its val split is the run's validation text (where `own`)
    data: str | None  # where the corpus was read: a path, or None for the default corpus
    own: bool  # the text the run was trained on; False: another text the user named, to be read whole


def read_run_text(run_dir: str | Path, state: dict[str, Any], tc: TrainConfig, tokenizer: Tokenizer,
                  data: str | Path | None = None, cache_dir: Path | None = None, fix: str = FIX_OTHERS,
                  advice: str = "pass the text the run was trained on", another: bool = True) -> RunText:
    """The text of the run in `run_dir` (`state`: its train_state.json, `tc`: its TrainConfig) through its
    tokenizer, checked against the sha256 the run recorded (module docstring). `data`: the text the user
    names: the run's corpus at a new place when its sha256 is the recorded one (or none is recorded), else
    another text (`own` False; `another` False: a resume, which takes no other text, is refused the run's
    validation text it cannot check rather than told to read `data` whole). A refusal is one DataError line
    ending in `fix`; `advice` ends the line for a text the user named that the tokenizer cannot encode."""
    cache_dir = cache_dir or default_cache_dir()
    trained_on, given = state.get("corpus_sha256"), data is not None
    if not given:  # the path the run recorded (None: the default corpus, which is the package's own)
        data = corpus_of(run_dir, state, None)
        files = _named_files(data, "corpus", run_dir)
        if data is not None or trained_on is not None:
            _check_named(files, data, "corpus", trained_on, run_dir, tc, fix)
        dataset = token_dataset(files, tokenizer, cache_dir, tc, data, advice)
        own = True
    else:  # the user's own choice: read as asked
        data = str(data)
        dataset = token_dataset(find_corpus_files(data), tokenizer, cache_dir, tc, data, advice)
        own = trained_on is None or dataset.header.get("content_sha256") == trained_on
    if own and tc.val_data is not None:  # a validation text of its own, named by the run folder
        val_on = state.get("val_sha256")
        if val_on is None and given and another:
            own = False  # the run's validation text cannot be read, and the user named one: that text, whole
        else:
            files = _named_files(tc.val_data, "validation text", run_dir)
            _check_named(files, tc.val_data, "validation text", val_on, run_dir, tc, fix)
            dataset = dataset.with_validation(token_dataset(files, tokenizer, cache_dir, tc, tc.val_data, advice))
    return RunText(dataset, data, own)


def _named_files(data: str | None, what: str, run_dir: str | Path) -> list[Path]:
    """The files of a text a run folder names, its control characters shown in any refusal."""
    try:
        return find_corpus_files(data)
    except DataError as e:
        raise DataError(f"the {what} {run_dir} was trained on: {shown(str(e))}") from None


def _check_named(files: list[Path], data: str | None, what: str, recorded: Any, run_dir: str | Path,
                 tc: TrainConfig, fix: str) -> None:
    """Refuse a text a run folder names unless the folder records its sha256 and the text has it; hashed
    before anything else reads it, and an unreadable file refused without a byte of it (module docstring)."""
    where = "the default corpus" if data is None else shown(data)
    if recorded is None:
        raise DataError(f"{run_dir} names its {what} {where} without the sha256 of that text, so it is not read "
                        f"(a run folder may come from anyone, and names no file to read); {fix}")
    try:
        digest, _ = text_digest(files, tc.invalid_utf8)
    except (DataError, OSError):  # not UTF-8, unreadable: not the text, and its bytes are not ours to show
        raise DataError(f"{where} cannot be read as the {what} {run_dir} was trained on; {fix}") from None
    if digest != recorded:
        raise DataError(f"{where} is not the {what} {run_dir} was trained on: it has changed since (its sha256 is "
                        f"not the one the run recorded); {fix}")
