"""The base of the methods that read a scores file (osa-weights, filter): the join of the scores to
the training shards, its options, its shortcuts and its summary."""

from __future__ import annotations

from dataclasses import dataclass

from pairclean.config import check_choice, parse_attachments, unpinned
from pairclean.errors import ConfigError
from pairclean.ops import distributed
from pairclean.ops.records import JsonObject, Keyed
from pairclean.scorefile.contract import columns_phrase
from pairclean.scorefile.db import check_attach_name
from pairclean.training.data import BatchPlan
from pairclean.training.methods.base import Method, MethodContext, Shortcut
from pairclean.training.weights import JOINS, ON_MISSING, build_weight_arrays


@dataclass
class ScoresOptions:
    scores: str | None = None  # the scores Parquet written by `pairclean score`
    filter: str | None = None  # DuckDB predicate over the scores: pairs where it is false are dropped
    attach: str | None = None  # NAME=FILE: a Parquet file the predicate reads as the table NAME (e.g. dedup output)
    join: str = "auto"
    on_missing: str = "error"
    allow_other_dataset: bool = unpinned(False)  # join scores that recorded other files than the training shards

    def __post_init__(self):
        check_choice(self.join, JOINS, "join")
        check_choice(self.on_missing, ON_MISSING, "on_missing")
        self.attachments()  # a malformed NAME=FILE fails with the other settings

    def attachments(self) -> Keyed[str, list[str]]:
        """{NAME: files} of `attach` (NAME=FILE, a glob naming several Parquet files)."""
        return parse_attachments([self.attach] if self.attach else [], check_name=check_attach_name)


def needs_scores(method: str, options: ScoresOptions) -> None:
    if not options.scores:
        raise ConfigError(f"method {method} needs a scores file: set scores FILE (the Parquet `pairclean score` "
                          "wrote)", "scores")


# Declared by filter (which it selects) and osa-weights; its help names the columns the predicate can use.
FILTER_SHORTCUT = Shortcut("--filter", "filter", "DuckDB predicate over the scores columns (" + columns_phrase()
                           + "; `pairclean query SCORES --columns` lists a file's); pairs where it is not true are "
                             "dropped (method filter, or with --weights).")

SCORES_SHORTCUTS = (
    Shortcut("--scores", "scores", "Scores Parquet the weights or the --filter predicate are read from."),
    Shortcut("--attach", "attach", "NAME=FILE: a Parquet file (e.g. `pairclean dedup` output) the --filter predicate "
                                   "reads as the table NAME."),
    Shortcut("--join", "join", "Join scores to shards by auto, shard-index or key."),
    Shortcut("--on-missing", "on_missing", "Pairs missing from the scores: error (default), drop, or keep (weight 1)."),
    Shortcut("--allow-other-dataset", "allow_other_dataset", "Use the scores with training shards whose files differ "
             "from the ones they recorded (another copy, or files changed since scoring: each row must still be the "
             "pair its key names).", kind=bool),
)


class ScoredMethod(Method):
    """A method whose per-pair weights (or keep/drop) come from a scores file joined per shard and index."""

    column: str | None = None  # the scores column read as the loss weight (None: keep/drop only)

    def __init__(self, options):
        super().__init__(options)
        self.join = None

    def input_files(self) -> list[str]:
        return [self.options.scores, *(f for files in self.options.attachments().values() for f in files)]

    def setup(self, ctx: MethodContext) -> BatchPlan:
        """The weight arrays, built once by rank 0 under torch.distributed (RUN_DIR is shared) and
        announced to every rank; in one process, built here."""
        o = self.options
        self.join = distributed.on_main(lambda: build_weight_arrays(
            o.scores, ctx.dataset, ctx.shards, ctx.run_dir, column=self.weight_column(), predicate=o.filter, join=o.join,
            on_missing=o.on_missing, attach=o.attachments(), allow_other_dataset=o.allow_other_dataset))
        return BatchPlan(weights_dir=self.join.directory, shard_files=self.join.shard_files, pairs=self.join.kept)

    def weight_column(self) -> str | None:
        return None

    def describe(self) -> JsonObject:
        return {**super().describe(), "join_summary": self.join.summary() if self.join else None}
