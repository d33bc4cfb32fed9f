"""The three tasks as data: files, columns, label rule, prediction column."""

from __future__ import annotations

from dataclasses import dataclass

@dataclass(frozen=True)
class TaskSpec:
    name: str
    files: dict[str, str]            # split -> file name in the data folder
    text_columns: tuple[str, ...]    # one column (single sentence) or two (pair)
    label_column: str
    label_kind: str                  # "class" (int 0..num_classes-1), "binary", "score" (0..5)
    num_classes: int                 # classes for "class"; 1 for binary/score
    prediction_column: str           # CS 224N output header

    @property
    def is_pair(self) -> bool:
        return len(self.text_columns) == 2

    def describe_label(self) -> str:
        if self.label_kind == "class":
            return f"an integer 0..{self.num_classes - 1}"
        if self.label_kind == "binary":
            return "0 or 1"
        return "a number in 0..5"


TASKS: dict[str, TaskSpec] = {
    "sst": TaskSpec(
        name="sst",
        files={"train": "ids-sst-train.csv", "dev": "ids-sst-dev.csv",
               "test": "ids-sst-test-student.csv"},
        text_columns=("sentence",),
        label_column="sentiment",
        label_kind="class",
        num_classes=5,
        prediction_column="Predicted_Sentiment",
    ),
    "qqp": TaskSpec(
        name="qqp",
        files={"train": "quora-train.csv", "dev": "quora-dev.csv"},
        text_columns=("sentence1", "sentence2"),
        label_column="is_duplicate",
        label_kind="binary",
        num_classes=1,
        prediction_column="Predicted_Is_Paraphrase",
    ),
    "sts": TaskSpec(
        name="sts",
        files={"train": "sts-train.csv", "dev": "sts-dev.csv", "test": "sts-test-student.csv"},
        text_columns=("sentence1", "sentence2"),
        label_column="similarity",
        label_kind="score",
        num_classes=1,
        prediction_column="Predicted_Similarity",
    ),
}
#: the tasks' names, in order: the one list of them
TASK_NAMES: tuple[str, ...] = tuple(TASKS)
