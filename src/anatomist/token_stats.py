"""The data's token statistics: how long the sequences of a dataset are (`--avg-seq-len`, `--lengths FILE`).

Padding-free training and packing (TRL's `padding_free`, `packing`; transformers'
DataCollatorWithFlattening) process the tokens the data has, not micro-batches padded to their
longest sequence: what drives their activations and time is the tokens per micro-batch. Without
them, the Trainer's collators pad each micro-batch to its longest sequence; the peak is that of a
micro-batch of sequences of the maximum length (`--seq-len`), and the padding costs time.

`--lengths FILE`: the token count of every example, one integer per line (or a JSON list of them),
as `len(tokenizer(text).input_ids)` gives them; counted after truncation to the maximum length, as
the trainers truncate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from anatomist.errors import InputError


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenStats:
    """Token counts of a dataset's examples, truncated to the maximum length."""

    lengths: tuple[int, ...]
    """Each example's tokens, at most `max_len`, in file order (empty: only the mean is known)."""
    mean_tokens: float
    """Tokens per example on average."""
    max_len: int
    """The maximum length (the trainer's max_length, anatomist's --seq-len)."""
    source: str
    """Where the figures came from (`--avg-seq-len`, or the file)."""

    @property
    def avg_seq_len(self) -> int:
        """The mean, rounded to a whole number of tokens (at least 1)."""
        return max(1, round(self.mean_tokens))

    def expected_longest(self, batch: int) -> float:
        """E[longest of `batch` examples drawn at random]: what an unpacked micro-batch is padded to.

        Exact for draws with replacement from the lengths: P(longest <= x) = F(x) ** batch."""
        if not self.lengths:
            return float(self.max_len)
        ordered = sorted(self.lengths)
        n, expected, below = len(ordered), 0.0, 0.0
        for i, value in enumerate(ordered, start=1):
            at_most = (i / n) ** batch
            expected += value * (at_most - below)
            below = at_most
        return expected

    def padding_share(self, batch: int) -> float:
        """Share of an unpacked micro-batch's tokens that are padding: 1 - mean / E[longest]."""
        return max(0.0, 1.0 - self.mean_tokens / self.expected_longest(batch))


def stats_from_mean(avg_seq_len: int, max_len: int) -> TokenStats:
    """`--avg-seq-len N`: the mean only.

    Raises:
        InputError: a mean that is not a positive number of tokens, or above the maximum length.
    """
    if avg_seq_len <= 0:
        raise InputError(f"--avg-seq-len must be greater than 0, got {avg_seq_len}")
    if avg_seq_len > max_len:
        raise InputError(f"--avg-seq-len {avg_seq_len} is above the maximum length {max_len} (--seq-len): an average "
                         "cannot exceed the longest sequence")
    return TokenStats(lengths=(), mean_tokens=float(avg_seq_len), max_len=max_len, source="--avg-seq-len")


def read_lengths(path: str, max_len: int) -> TokenStats:
    """`--lengths FILE`: one token count per line, or a JSON list of them.

    Raises:
        InputError: a missing or empty file, or an entry that is not a positive whole number (named by line).
    """
    file = Path(path)
    if not file.is_file():
        raise InputError(f"--lengths {path!r}: no such file")
    text = file.read_text()
    if not text.strip():
        raise InputError(f"--lengths {path!r} is empty")
    values: list[int] = []
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise InputError(f"--lengths {path!r}: not valid JSON ({exc})") from None
        entries = [(f"entry {i + 1}", v) for i, v in enumerate(data)] if isinstance(data, list) else [("the file", data)]
    else:
        entries = [(f"line {i + 1}", line.strip()) for i, line in enumerate(text.splitlines()) if line.strip()]
    for where, value in entries:
        number = value if isinstance(value, int) and not isinstance(value, bool) else (
            int(value) if isinstance(value, str) and value.isdigit() else None)
        if number is None or number <= 0:
            raise InputError(f"--lengths {path!r}: {where} is {value!r}, not a positive whole number of tokens")
        values.append(min(number, max_len))
    if not values:
        raise InputError(f"--lengths {path!r}: no lengths in it")
    return TokenStats(lengths=tuple(values), mean_tokens=sum(values) / len(values), max_len=max_len,
                      source=f"{path} ({len(values):,} examples)")
