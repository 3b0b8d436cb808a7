"""First use IV (issue 56), one test per must-show: nothing silent for minutes (beta and finalize
report progress from their start, on a terminal and in a log), mistakes named before any model is
built (in one line naming the flag), output that fits COLUMNS, help in the order of the work, no
collision in README's flow, a missing extra named, and the small things. docs/first-use.md shows
each with the command a user types."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import run_cli, text_pairs
from test_terminal import COMMANDS, shown

from pairclean.ops.progress import Progress, ProgressTask

ROOT = Path(__file__).parent.parent
TINY = ["--model", "pairclean-tiny", "--pretrained", "none", "--workers", "0", "--beta-k", "64"]


class _Recorded(Progress):
    """Every note and task, in the order they came, with each task's count."""

    def __init__(self):
        self.events = []

    @contextlib.contextmanager
    def task(self, label, total=None, completed=0, **fields):
        count = {"label": label, "total": total, "done": completed}
        self.events.append(("task", count))

        class Task(ProgressTask):
            def update(self, advance=0, **fields):
                count["done"] += advance

        yield Task()

    def note(self, message, *fields):
        self.events.append(("note", (message, fields)))


# ------------------------------------------------------------------ 1. nothing silent for minutes

def test_beta_says_what_it_does_and_counts_its_inputs_from_the_start(tiny_estimator, tmp_path):
    """Before: 462 s of nothing between "reading ..." and the scoring bar (ViT-B-32, random weights,
    CPU). Now a note names the work, the cache and what shortens it, then a task counts the 2K
    inputs block by block."""
    from pairclean.scoring.beta_cache import BetaCache, cached_random_input_beta

    progress = _Recorded()
    cached_random_input_beta(tiny_estimator, "image", "text", k=200, seed=0, cache=BetaCache(tmp_path),
                             progress=progress)
    (kind, (message, fields)), (task_kind, count) = progress.events
    assert kind == "note" and task_kind == "task"
    assert "400 random inputs" in message and str(tmp_path) in message and fields == ("beta_k", "beta_mode")
    assert "`beta_k` 50" in message and "`beta_mode` shuffled" in message
    assert count == {"label": "beta: random images and texts", "total": 400, "done": 400}
    progress = _Recorded()
    cached_random_input_beta(tiny_estimator, "image", "text", k=200, seed=0, cache=BetaCache(tmp_path),
                             progress=progress)
    assert progress.events == []  # read from the cache: nothing to wait for


def test_off_a_terminal_a_task_is_a_line_at_its_start_every_few_seconds_and_at_its_end(monkeypatch):
    """A log or CI got nothing from a rich bar until the task ended; now a line when it starts
    (before anything is counted), every LOG_EVERY seconds with the time left, and when it ends."""
    import io

    import pairclean.cli.progress as cli_progress
    from pairclean.cli.terminal import LiteralConsole

    monkeypatch.setattr(cli_progress, "LOG_EVERY", 0.05)
    sink = io.StringIO()
    progress = cli_progress.RichProgress(LiteralConsole(file=sink, force_terminal=False))
    with progress.task("beta: random images and texts", total=4) as task:
        assert sink.getvalue() == "beta: random images and texts: 0/4  0:00:00\n"  # at once
        for _ in range(4):
            time.sleep(0.06)
            task.update(advance=1)
    lines = sink.getvalue().splitlines()
    assert len(lines) == 5 and lines[-1].startswith("beta: random images and texts: 4/4  0:00:00")
    assert all(re.search(r"about 0:00:0\d left$", line) for line in lines[1:4]), lines


def test_score_in_a_log_shows_the_model_load_beta_scoring_and_finalize_in_order(coco_shards, tmp_path, capsys,
                                                                                monkeypatch):
    monkeypatch.setenv("PAIRCLEAN_CACHE_DIR", str(tmp_path / "cache"))
    code, out, err = run_cli(["score", coco_shards, "--out", tmp_path / "s.parquet", *TINY], capsys)
    assert code == 0, err
    starts = [next(i for i, line in enumerate(out.splitlines()) if line.startswith(prefix)) for prefix in (
        "reading WebDataset", "loading pairclean-tiny (open_clip, random weights)", "beta: 128 random inputs",
        "beta: random images and texts: 0/128", "scoring: 0/3", "finalize (2 passes): 0/32",
        "pairclean score -> ")]
    assert starts == sorted(starts), out
    assert "shorter: --beta-k 16, or --beta-mode shuffled" in out


# ------------------------------------------------------------------ 2. mistakes named before any model is built

@pytest.fixture
def no_model(monkeypatch):
    """Building a model fails the test: what is refused must be refused before."""
    import pairclean.scoring.model as model

    def built(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(model, "build_estimator", built)


def _one_line(capsys, argv) -> str:
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


def test_parquet_columns_named_otherwise_are_refused_naming_the_flags(coco_parquet, tmp_path, capsys, no_model):
    """Before: after 8 s of loading, `column(s) ['image', 'caption'] not in other.parquet (has
    ['TEXT', 'URL'])` as the run's failure, with no word of the flags."""
    table = pq.read_table(coco_parquet)
    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"TEXT": table["caption"], "IMG": table["image"], "URL": table["key"]}), other)
    err = _one_line(capsys, ["score", other, "--out", tmp_path / "s.parquet", *TINY])
    assert err == ("error: other.parquet has no column 'image' for the images (name it with --image-field, or "
                   "--image-path-field for paths; did you mean 'IMG'?) and no column 'caption' for the captions "
                   "(name it with --text-field; its text columns: TEXT, URL); its columns: TEXT, IMG, URL")
    assert not (tmp_path / "s.run.json").exists()
    code, _, err = run_cli(["score", other, "--out", tmp_path / "s.parquet", *TINY, "--image-field", "IMG",
                            "--text-field", "TEXT", "--key-field", "URL"], capsys)
    assert code == 1 and "AssertionError: a model was built" in err  # the corrected command gets as far as the model


def test_text_text_on_image_text_shards_says_what_the_data_hold(coco_shards, tmp_path, capsys, no_model):
    """Before: every pair scored, then "every pair (400) is an error row: missing second text"."""
    err = _one_line(capsys, ["score", coco_shards, "--pair", "text-text", "--out", tmp_path / "s.parquet", *TINY])
    assert err == ("error: coco-mini-000000.tar (its first 16 samples) has no member 'txt2' for the second texts "
                   "(name it with --text2-field); its members: jpg, txt; they hold image-text pairs (--pair image-text)")


def test_a_model_name_typo_is_answered_with_the_names_it_may_mean(coco_shards, tmp_path, capsys, no_model):
    err = _one_line(capsys, ["score", coco_shards, "--out", tmp_path / "s.parquet", "--model", "ViT-B-23"])
    assert err.startswith("error: unknown model 'ViT-B-23': did you mean ViT-B-32")
    err = _one_line(capsys, ["score", coco_shards, "--out", tmp_path / "s.parquet", "--model", "vit-b-32"])
    assert "did you mean ViT-B-32" in err
    err = _one_line(capsys, ["score", coco_shards, "--out", tmp_path / "s.parquet", "--pretrained", "opneai"])
    assert "--pretrained 'opneai' is neither a file nor a tag of ViT-B-32: did you mean openai?" in err


@pytest.mark.parametrize("out", ["", ".", ".."])
def test_an_out_that_names_no_file_is_a_usage_error(coco_shards, capsys, out, no_model):
    """Before: "unexpected error: ValueError: PosixPath('.') has an empty name", exit 1, a crash log."""
    err = _one_line(capsys, ["score", coco_shards, "--out", out, *TINY])
    assert err.startswith("error: Invalid value for '--out' / '-o': names no file") and "is a directory" in err


# ------------------------------------------------------------------ 3. output that fits COLUMNS

def _abstaining(directory: Path) -> list:
    """Embeddings on which the GMM abstains, and the score command over them."""
    from pairclean.data.embeddings import write_embeddings

    rng = np.random.default_rng(0)
    left = rng.standard_normal((600, 16))
    right = left + 0.6 * rng.standard_normal((600, 16))
    write_embeddings(directory / "emb", [(left.astype(np.float32), right.astype(np.float32),
                                          [f"k{i}" for i in range(600)])])
    return ["score", directory / "emb", "--from-embeddings", "--out", directory / "s.parquet", "--beta-mode", "fixed",
            "--beta", "0.1"]


@pytest.mark.parametrize("terminal", [False, True])
def test_at_100_columns_no_line_of_the_score_summary_is_wider(tmp_path, capsys, monkeypatch, terminal):
    """Before: 129 columns in a log when the GMM abstains (its reason in the row's label)."""
    monkeypatch.setenv("COLUMNS", "100")
    if terminal:
        monkeypatch.setenv("TTY_COMPATIBLE", "1")
    code, out, err = run_cli(_abstaining(tmp_path), capsys)
    lines = shown(out).splitlines()
    assert code == 0 and "abstains: the two components overlap" in " ".join(" ".join(lines).split()), err
    assert "beta (fixed)" in out and "K=None" not in out
    assert max(map(len, lines)) <= 100, "\n".join(line for line in lines if len(line) > 100)


@pytest.mark.parametrize("terminal", [False, True])
def test_at_100_columns_the_method_options_fit(capsys, monkeypatch, terminal):
    """Before: 903 columns (one line per method, six columns side by side)."""
    monkeypatch.setenv("COLUMNS", "100")
    if terminal:
        monkeypatch.setenv("TTY_COMPATIBLE", "1")
    code, out, err = run_cli(["train", "--method-option", "help"], capsys)
    lines = shown(out).splitlines()
    assert code == 0 and max(map(len, lines)) <= 100, err
    text = " ".join(" ".join(lines).split())
    assert "[loss, zeta * Psi]" in text and "gmm_reg_covar=0.001" in text  # wrapped, not cut


def test_without_columns_a_log_keeps_whole_lines(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    code, out, _ = run_cli(_abstaining(tmp_path), capsys)
    (row,) = [line for line in out.splitlines() if "flagged by GMM rule" in line]
    assert code == 0 and row.rstrip().endswith("0.0%") and len(row) > 100


@pytest.mark.parametrize("command", COMMANDS)
def test_every_help_page_fits_100_columns(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    code, out, err = run_cli([*command.split(), "--help"], capsys)
    assert code == 0 and max(len(line) for line in out.splitlines()) <= 100, err


# ------------------------------------------------------------------ 4. help in the order of the work

def _sections(out: str) -> list[str]:
    return [line.rstrip(":") for line in out.splitlines() if re.match(r"^[A-Z][^ ].*:$", line)]


def test_the_command_list_follows_the_work(capsys):
    """Before: alphabetical (audit, audit-import, dedup, filter, corrupt, demo, query, ...)."""
    code, out, _ = run_cli(["--help"], capsys)
    listed = [line.split()[0] for line in out.split("Score, then look at the scores:")[1].splitlines()
              if line.startswith("  ")]
    assert listed == ["score", "query", "report", "audit", "audit-import", "filter", "train", "dedup", "evaluate",
                      "bench", "demo", "corrupt", "synth"]


def test_score_help_leads_with_what_a_user_needs_first(capsys):
    """Before: 142 lines in one list, --from-embeddings last, after --help."""
    code, out, _ = run_cli(["score", "--help"], capsys)
    assert _sections(out) == ["Arguments", "Modes", "What to score, with which model, into what",
                              "Decisions: beta, the rules, the weights", "Performance", "Past one machine: a Ray cluster",
                              "Reading the data (where detection needs help)",
                              "Embeddings for dedup and rescoring", "Other options"]
    flags = re.findall(r"^  (?:-o, )?(--[a-z0-9-]+)", out, re.MULTILINE)
    assert flags[:5] == ["--from-embeddings", "--out", "--pair", "--model", "--pretrained"]
    assert flags.count("--from-embeddings") == 1 and flags[-1] == "--help"


def test_train_help_leads_with_the_scores_flags(capsys):
    """Before: --weights, --scores, --filter, --online after about 35 generic options."""
    code, out, _ = run_cli(["train", "--help"], capsys)
    flags = re.findall(r"^  (?:-o, )?(--[a-z0-9-]+)", out, re.MULTILINE)
    assert flags.index("--epochs") > max(flags.index(f) for f in ("--weights", "--scores", "--filter", "--online"))
    assert max(flags.index(f) for f in ("--weights", "--scores", "--filter", "--online")) < 12
    assert _sections(out)[:3] == ["Arguments", "What to train, on what, into what",
                                  "The scores: weights, filter, online weights, methods"]


# ------------------------------------------------------------------ 5. README's flow without collisions

def test_one_scores_file_evaluated_against_two_truths_keeps_both(coco_scores, truth, tmp_path, capsys):
    """Before: SCORES.detection.json for every truth, so the audit's marks after the injected truth
    stopped with "exists; pass --overwrite"."""
    scores = tmp_path / "scores.parquet"
    scores.write_bytes(Path(coco_scores).read_bytes())
    marks = tmp_path / "audit-truth.parquet"
    pq.write_table(pq.read_table(truth), marks)
    for given, name in ((truth, "scores.detection.truth.json"), (marks, "scores.detection.audit-truth.json")):
        code, out, err = run_cli(["evaluate", "detection", scores, "--truth", given], capsys)
        assert code == 0 and f"metrics written to {tmp_path / name}" in out, err
    assert json.loads((tmp_path / "scores.detection.truth.json").read_text())["rules"]


def test_the_demo_says_it_replaces_its_own_output(capsys):
    code, out, _ = run_cli(["demo", "--help"], capsys)
    text = " ".join(out.split())
    assert "An earlier demo's output there is replaced (it needs no --overwrite" in text
    assert "any other directory that is not empty is refused" in text


# ------------------------------------------------------------------ 6. a missing extra is one line naming it

def test_every_extra_that_brings_a_module_is_named_by_the_one_helper():
    from pairclean.ops.extras import EXTRAS

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(declared) - {"test", "dev"} <= set(EXTRAS)


@pytest.mark.parametrize("module, extra, argv", [
    ("s3fs", "s3", ["score", "s3://bucket/shards/*.tar", "--out", "s.parquet"]),
    ("s3fs", "s3", ["score", "s3://bucket/shards/000.tar", "--out", "s.parquet"]),
    ("gcsfs", "gcs", ["score", "gs://bucket/shards/000.tar", "--out", "s.parquet"]),
])
def test_a_missing_filesystem_names_its_extra(module, extra, argv, capsys, monkeypatch, tmp_path, no_model):
    monkeypatch.setitem(sys.modules, module, None)  # what importing it does where it is not installed
    monkeypatch.chdir(tmp_path)
    err = _one_line(capsys, argv)
    assert f"need the {extra} extra, which is not installed (no module {module}): pip install 'pairclean[{extra}]'" in err


def test_a_missing_device_decoder_package_names_the_gpu_extra(monkeypatch):
    from pairclean.backends.device_jpeg import DEVICE_DECODERS

    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", None)
    assert "pip install 'pairclean[gpu]' (in a clone: pip install -e '.[gpu]')" in DEVICE_DECODERS["nvimgcodec"].unavailable()


def test_a_missing_ray_names_the_ray_extra(monkeypatch):
    from pairclean.ops.extras import MissingExtra, optional

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(MissingExtra, match=r"need the ray extra, which is not installed \(no module ray\): "
                                           r"pip install 'pairclean\[ray\]'"):
        optional("ray", "ray")


def test_readmes_text_text_line_without_the_text_extra_is_one_line(coco_src, tmp_path):
    """Before: "unexpected error: ModuleNotFoundError: ... sentence_transformers" and a crash log."""
    captions = text_pairs(coco_src, tmp_path / "captions").parent
    code = ("import sys; sys.modules['sentence_transformers'] = None\n"
            "from pairclean.cli import main\n"
            f"main(['score', {str(captions)!r}, '--out', {str(tmp_path / 's.parquet')!r}, '--pair', 'text-text', "
            "'--model', 'all-MiniLM-L6-v2'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    err = done.stderr.strip()
    assert done.returncode == 2 and len(err.splitlines()) == 1, err
    assert err == ("error: sentence-transformers models (text-text pairs) need the text extra, which is not installed "
                   "(no module sentence_transformers): pip install 'pairclean[text]' (in a clone: pip install -e "
                   "'.[text]')")


# ------------------------------------------------------------------ 7. small things

def test_evaluate_without_a_recorded_truth_says_so_plainly(coco_scores, capsys):
    err = _one_line(capsys, ["evaluate", "detection", coco_scores])
    assert err.endswith("names no truth file (the dataset it scored records none, as data `corrupt` wrote would): "
                        "give --truth")


def test_query_to_a_file_says_what_it_wrote(coco_scores, tmp_path, capsys):
    code, out, err = run_cli(["query", coco_scores, "SELECT key, sim FROM scores", "--format", "parquet", "--out",
                              tmp_path / "q.parquet"], capsys)
    assert code == 0 and out.strip() == f"16 rows (parquet) written to {tmp_path / 'q.parquet'}", err
    assert pq.read_table(tmp_path / "q.parquet").num_rows == 16
