"""Prompts for the rollout: the :class:`Prompt` record, the :class:`PromptSource` protocol, the demo's
synthetic arithmetic task and JSONL / Parquet datasets read through HF ``datasets``.

A source hands out prompts in batches and can say where it is (``state_dict``) and go back there
(``load_state_dict``), so a resumed run continues with the prompts it would have seen next. With
``task.chat_template`` a dataset's prompts (strings, or lists of chat messages as verl and slime store
DAPO-Math) are rendered by the tokenizer's chat template with the generation prompt
(:func:`chat_renderer`).
"""
from __future__ import annotations

import json
import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from megarl.tasks import arithmetic

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    """One prompt. ``text`` is what the policy is given; ``answer`` is what rule-based rewards compare
    against (None when the task has none, e.g. a reward model scores it); ``metadata`` holds the
    dataset row's other fields. ``plain_text`` is the prompt as the row wrote it, without a chat
    template's markers (:func:`plain_text_of`): what a judge or a reward model reads; ``text`` when
    not given."""

    text: str
    answer: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    plain_text: str | None = None

    def __post_init__(self):
        if self.plain_text is None:
            object.__setattr__(self, "plain_text", self.text)


class BadPrompt(ValueError):
    """A row of a prompt source that is no prompt (no string, a chat template that cannot render it).
    The source has moved past it: the next draw is the next row."""


class PromptSource(Protocol):
    """An endless stream of prompts with a resumable position."""

    def next_batch(self, n: int) -> list[Prompt]:
        """The next ``n`` prompts; :class:`BadPrompt` for a row that is none (skipped)."""
        ...

    def state_dict(self) -> dict:
        """The position in the stream, JSON-serialisable."""
        ...

    def load_state_dict(self, state: dict) -> None:
        """Continue from a position returned by :meth:`state_dict` of a source made the same way."""
        ...


class ArithmeticSource:
    """The demo task (``megarl.tasks.arithmetic``): problems drawn uniformly with replacement, from those
    whose prompt is not in ``exclude`` (the held-out ones, :mod:`megarl.tasks.heldout`)."""

    def __init__(self, max_operand: int = 9, seed: int = 0, exclude: frozenset[str] = frozenset()):
        self.max_operand = max_operand
        self._rng = random.Random(seed)
        self._problems = [p for p in arithmetic.all_problems(max_operand) if p.prompt not in exclude]

    def next_batch(self, n: int) -> list[Prompt]:
        picked = [self._problems[self._rng.randrange(len(self._problems))] for _ in range(n)]
        return [Prompt(text=p.prompt, answer=p.answer) for p in picked]

    def state_dict(self) -> dict:
        version, internal, gauss_next = self._rng.getstate()
        return {"rng_state": [version, list(internal), gauss_next]}

    def load_state_dict(self, state: dict) -> None:
        version, internal, gauss_next = state["rng_state"]
        self._rng.setstate((version, tuple(internal), gauss_next))


class DatasetSource:
    """Prompts from a JSONL or Parquet file, one row each, read with HF ``datasets``.

    ``prompt_key`` must name a string field of every row (with ``render``: whatever ``render`` takes,
    e.g. a list of chat messages; the prompt is its result); ``answer_key`` (None: no answers) a field
    whose value becomes ``Prompt.answer`` as a string; the other fields go to ``Prompt.metadata``.
    The rows are visited epoch by epoch, in a seeded permutation per epoch when ``shuffle``; the rows of
    ``exclude`` (indices: the held-out ones, :mod:`megarl.tasks.heldout`) never.
    A missing field raises ValueError naming the field, the file and the fields it has; a row
    without a usable prompt raises :class:`BadPrompt` as it is drawn (and is left behind).
    """

    FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}

    def __init__(self, path: str | Path, prompt_key: str = "prompt", answer_key: str | None = "answer",
                 shuffle: bool = True, seed: int = 0, file_format: str | None = None,
                 render: Callable[[Any], str] | None = None, exclude: frozenset[int] = frozenset()):
        import datasets

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"prompt dataset {self.path} does not exist")
        builder = {"jsonl": "json", "parquet": "parquet"}.get(file_format or "", None) or \
            self.FORMATS.get(self.path.suffix)
        if builder is None:
            raise ValueError(f"{self.path}: cannot tell the format from the suffix {self.path.suffix!r}; "
                             "use .jsonl or .parquet (or pass file_format)")
        self._rows = datasets.load_dataset(builder, data_files=str(self.path), split="train")
        fields = list(self._rows.column_names)
        for role, key in (("prompt_key", prompt_key), ("answer_key", answer_key)):
            if key is not None and key not in fields:
                raise ValueError(f"{self.path}: no field {key!r} ({role}); the rows have fields {fields}")
        if len(self._rows) == 0:
            raise ValueError(f"{self.path}: the dataset has no rows")
        self.prompt_key, self.answer_key = prompt_key, answer_key
        self.shuffle, self.seed, self.render, self.exclude = shuffle, seed, render, exclude
        if len(exclude) >= len(self._rows):
            raise ValueError(f"{self.path}: every one of its {len(self._rows)} rows is held out for evaluation")
        self.epoch, self.index = 0, 0
        self._order = self._permutation(0)

    def __len__(self) -> int:
        return len(self._rows)

    def _permutation(self, epoch: int) -> list[int]:
        order = [i for i in range(len(self._rows)) if i not in self.exclude]
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def column(self, key: str) -> list:
        """Every row's ``key`` field, in the file's order."""
        return self._rows[key]

    def row(self, row_index: int) -> Prompt:
        """Row ``row_index`` of the file as a prompt (:class:`BadPrompt` when it is none)."""
        return self._prompt(row_index)

    def _prompt(self, row_index: int) -> Prompt:
        row = self._rows[row_index]
        text = written = row[self.prompt_key]
        if self.render is not None:
            try:
                text = self.render(written)
            except ValueError as exc:
                raise BadPrompt(f"{self.path}: row {row_index}: {exc}") from exc
        elif isinstance(text, list):
            raise BadPrompt(f"{self.path}: row {row_index}'s {self.prompt_key!r} is a list (chat messages?): "
                            "set task.chat_template=true to render it with the tokenizer's chat template")
        if not isinstance(text, str):
            raise BadPrompt(f"{self.path}: row {row_index} has no string {self.prompt_key!r} "
                            f"(got {type(text).__name__})")
        answer = None
        if self.answer_key is not None and row[self.answer_key] is not None:
            answer = str(row[self.answer_key])
        metadata = {k: v for k, v in row.items() if k not in (self.prompt_key, self.answer_key)}
        return Prompt(text=text, answer=answer, metadata=metadata,
                      plain_text=plain_text_of(written) if self.render is not None else None)

    def next_batch(self, n: int) -> list[Prompt]:
        out = []
        for _ in range(n):
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
                log.info("%s: epoch %d", self.path, self.epoch)
            row, self.index = self._order[self.index], self.index + 1  # past it even if it is no prompt
            out.append(self._prompt(row))
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self.epoch)


# The valid task.name values (the config is checked against them at load): the synthetic demo task,
# and the datasets read from task.path.
DATASET_TASKS = ("jsonl", "parquet")
TASKS = ("arithmetic", *DATASET_TASKS)


def dataset_fields(path: str | Path, file_format: str, max_rows: int = 100) -> list[str] | None:
    """The field names of a ``jsonl`` / ``parquet`` dataset, read without loading it: the keys of
    the first ``max_rows`` JSON lines (in order of appearance), or the Parquet schema. Every line of a
    JSON Lines file is parsed (HF ``datasets`` cannot load a file with one bad line): ValueError naming
    the file and the line for a line that is not a JSON object. None for a JSON document rather than
    JSON Lines (the full read, :class:`DatasetSource`, decides then). ValueError for an empty or
    unreadable file."""
    path = Path(path)
    if file_format == "parquet":
        import pyarrow.parquet as pq

        try:
            return list(pq.read_schema(path).names)
        except Exception as exc:  # pyarrow raises several types for "not a Parquet file"
            raise ValueError(f"{path} is not a readable Parquet file ({type(exc).__name__}: {exc})") from exc
    names: dict[str, None] = {}
    rows = 0
    with path.open(encoding="utf-8-sig", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            row = _json_line(path, number, line, first=rows == 0)
            if row is None:
                return None
            if rows < max_rows:
                names.update(dict.fromkeys(row))
            rows += 1
    if rows == 0:
        raise ValueError(f"{path} has no rows")
    return list(names)


def _json_line(path: Path, number: int, line: str, first: bool) -> dict | None:
    """Line ``number`` of a JSON Lines file as a dict; None when it is the ``first`` row and the whole file
    is one JSON document instead; ValueError naming the file and the line otherwise."""
    try:
        row = json.loads(line.rstrip())
    except json.JSONDecodeError as exc:
        if first and _is_json_document(path):
            return None
        raise ValueError(f"{path} line {number} is not valid JSON ({exc.msg} at column {exc.colno}): "
                         f"{line.strip()[:80]!r}") from exc
    if not isinstance(row, dict):
        if first and isinstance(row, list):
            return None
        raise ValueError(f"{path} line {number} is a JSON {type(row).__name__}, not an object of fields: "
                         f"{line.strip()[:80]!r}")
    return row


def _is_json_document(path: Path) -> bool:
    """Whether the whole file is one JSON value (a document the datasets library reads as rows)."""
    try:
        json.loads(path.read_text(encoding="utf-8-sig", errors="replace"))
    except json.JSONDecodeError:
        return False
    return True


def has_chat_template(hf_path: str | Path) -> bool:
    """Whether the tokenizer saved with an HF checkpoint carries a chat template
    (``chat_template.jinja`` / ``chat_template.json``, or ``tokenizer_config.json``'s
    ``chat_template``), read without loading the tokenizer."""
    path = Path(hf_path)
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    config = path / "tokenizer_config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))


def chat_renderer(tokenizer) -> Callable[[Any], str]:
    """``render(prompt) -> text``: ``prompt`` (a string: one user turn; or a list of ``{"role",
    "content"}`` messages) through the tokenizer's chat template, with the generation prompt. The
    text holds the template's special tokens (a BOS among them): tokenize it without adding them."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"task.chat_template: the tokenizer ({tokenizer.name_or_path}) has no chat template")

    def render(prompt: Any) -> str:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not (isinstance(messages, list) and messages
                and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                        for m in messages)):
            raise ValueError(f"a prompt to render is a string or a list of {{'role', 'content'}} messages, "
                             f"got {str(prompt)[:80]!r}")
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    return render


def plain_text_of(prompt: str | list[dict]) -> str:
    """A prompt as plain text, as a judge reads it: a string as it is; one chat message's content; several
    messages as ``"role: content"`` paragraphs (e.g. ``"system: ...\n\nuser: ..."``)."""
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1:
        return prompt[0]["content"]
    return "\n\n".join(f"{m['role']}: {m['content']}" for m in prompt)


def make_prompt_source(task, tokenizer=None, exclude: frozenset = frozenset()) -> PromptSource:
    """The source a ``TaskConfig`` (``cfg.task``) describes: ``name`` one of :data:`TASKS`;
    ``tokenizer`` renders a dataset's prompts when ``task.chat_template`` is set; ``exclude``: the held-out
    prompts (:mod:`megarl.tasks.heldout`): the arithmetic task's prompt texts, a dataset's row indices."""
    if task.name == "arithmetic":
        return ArithmeticSource(max_operand=task.max_operand, seed=task.seed, exclude=exclude)
    if task.name in DATASET_TASKS:
        if not task.path:
            raise ValueError(f"task.path: task {task.name} needs the dataset file")
        render = chat_renderer(tokenizer) if task.chat_template else None
        return DatasetSource(task.path, prompt_key=task.prompt_key, answer_key=task.answer_key or None,
                             shuffle=task.shuffle, seed=task.seed, file_format=task.name, render=render,
                             exclude=exclude)
    raise ValueError(f"task.name: {task.name!r} is not one of {', '.join(TASKS)}")
