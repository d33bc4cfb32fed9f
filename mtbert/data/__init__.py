"""Data: read and validate the CS 224N files, carve the validation split, cache token
ids in Parquet, and build length-bucketed, padded batches.  One module a job:

- :mod:`~mtbert.data.files`: a file -> validated rows (:func:`read_task_file`, :class:`RawTable`);
- :mod:`~mtbert.data.tokens`: rows -> token ids, cached in Parquet keyed by tokenizer, max
  length and file checksum (:func:`tokenize_cached`, :class:`TokenTable`);
- :mod:`~mtbert.data.splits`: every task's splits, the validation split carved from train
  (:func:`load_data`, :class:`MultitaskData`, :class:`Split`);
- :mod:`~mtbert.data.batching`: index batches (:class:`TaskBatcher`) -> padded tensors
  (:func:`collate`), the evaluation batches.

The names below are the package's interface; import them from ``mtbert.data``.
"""

from mtbert.data.batching import (EVAL_ROWS_CPU, EVAL_ROWS_GPU, EVAL_TOKENS_CPU,
                                  EVAL_TOKENS_GPU, ROW_WEIGHTS, STATIC_LENGTHS, SharedBuckets,
                                  TaskBatcher,
                                  collate, encoding_for, eval_batches, eval_rows,
                                  eval_token_cap, pad_rows, real_rows, static_length)
from mtbert.data.files import RawTable, read_task_file
from mtbert.data.splits import MultitaskData, Split, carve_validation, load_data
from mtbert.data.tokens import CacheStats, Ragged, TokenTable, tokenize_cached

__all__ = ["EVAL_ROWS_CPU", "EVAL_ROWS_GPU", "EVAL_TOKENS_CPU", "EVAL_TOKENS_GPU", "ROW_WEIGHTS",
           "STATIC_LENGTHS", "CacheStats", "MultitaskData", "Ragged", "RawTable", "SharedBuckets", "Split",
           "TaskBatcher", "TokenTable", "carve_validation", "collate", "encoding_for",
           "eval_batches", "eval_rows", "eval_token_cap", "load_data", "pad_rows",
           "read_task_file", "real_rows", "static_length", "tokenize_cached"]
